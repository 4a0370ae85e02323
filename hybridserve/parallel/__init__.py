"""Decode context parallel: KV sharded by token across ranks, merged by log-sum-exp (SPEC.md 4).

Imports torch; nothing in core, kvcache, scheduler, engine or sim may import this package.
"""

from hybridserve.parallel.group import DcpGroup, all_gather_heads, merge_across_ranks
from hybridserve.parallel.launch import init_from_env, run_ranks
from hybridserve.parallel.layer import AttentionRows, dcp_attention
from hybridserve.parallel.merge import merge_attention_states
from hybridserve.parallel.mla import MlaCaches, MlaConfig, MlaWeights, mla_attention, prepare_rows
from hybridserve.parallel.sharding import local_seq_lens

__all__ = [
    "AttentionRows",
    "DcpGroup",
    "MlaCaches",
    "MlaConfig",
    "MlaWeights",
    "all_gather_heads",
    "dcp_attention",
    "init_from_env",
    "local_seq_lens",
    "merge_across_ranks",
    "merge_attention_states",
    "mla_attention",
    "prepare_rows",
    "run_ranks",
]
