"""Work each rank of a gloo group runs in the multi-process tests; with `DcpGroup()` the same
functions give the single-process reference."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridserve.parallel import AttentionRows, DcpGroup, dcp_attention
from hybridserve.parallel.demo_models import TinyDecoder, TinyModelConfig
from hybridserve.parallel.demo_runner import DecodeScenario, run_scenario
from hybridserve.parallel.group import all_gather_heads
from hybridserve.parallel.mla import MlaCaches, MlaConfig, MlaWeights, mla_attention, prepare_rows

BLOCK_SIZE = 4
HEADS, KV_HEADS, DIM = 4, 2, 8
PROMPT_LENS = (1, 13, 30)
DECODE_STEPS = 2
PREFILL_CHUNK = 8
SPARSE_MLA = MlaConfig(index_top_k=5)
MODELS = {
    "gqa": TinyModelConfig(),
    "mla": TinyModelConfig(attention="mla"),
    "sparse_mla": TinyModelConfig(attention="mla", mla=SPARSE_MLA),
}
MODEL_SEED = 1


def gqa_inputs(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per sequence q `[tokens, heads, d]`, k and v `[tokens, kv_heads, d]`, float64."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(n + DECODE_STEPS, HEADS, DIM, generator=gen, dtype=torch.float64),
            torch.randn(n + DECODE_STEPS, KV_HEADS, DIM, generator=gen, dtype=torch.float64),
            torch.randn(n + DECODE_STEPS, KV_HEADS, DIM, generator=gen, dtype=torch.float64),
        )
        for n in PROMPT_LENS
    ]


def _gqa_step(dcp: DcpGroup, inputs, caches, chunks: list[tuple[int, int, int]]) -> torch.Tensor:
    """One batched step: `(sequence, start, stop)` chunks of rows."""
    seqs = [s for s, start, stop in chunks for _ in range(start, stop)]
    positions = torch.tensor([p for _, start, stop in chunks for p in range(start, stop)])
    tables = torch.tensor([[8 * s + b for b in range(8)] for s in seqs])
    rows = AttentionRows(positions, tables, BLOCK_SIZE)
    q, k, v = (
        torch.stack([inputs[s][i][p] for s, p in zip(seqs, positions.tolist(), strict=True)])
        for i in range(3)
    )
    return dcp_attention(
        q, k, v, k_cache=caches[0], v_cache=caches[1], rows=rows, dcp=dcp, scale=DIM**-0.5
    )


def gqa_attention_steps(dcp: DcpGroup) -> dict[str, torch.Tensor]:
    """Chunked prefill of all sequences in mixed batches, then batched decode steps."""
    inputs = gqa_inputs()
    shape = (32, BLOCK_SIZE, KV_HEADS, DIM)
    caches = (torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64))
    prefill = []
    starts = [0] * len(PROMPT_LENS)
    while any(start < n for start, n in zip(starts, PROMPT_LENS, strict=True)):
        chunks = []
        for s, n in enumerate(PROMPT_LENS):
            if starts[s] < n:
                chunks.append((s, starts[s], min(starts[s] + PREFILL_CHUNK, n)))
                starts[s] = chunks[-1][2]
        prefill.append(_gqa_step(dcp, inputs, caches, chunks))
    decode = [
        _gqa_step(dcp, inputs, caches, [(s, n + i, n + i + 1) for s, n in enumerate(PROMPT_LENS)])
        for i in range(DECODE_STEPS)
    ]
    return {"prefill": torch.cat(prefill), "decode": torch.cat(decode)}


def mla_inputs(seed: int = 0) -> tuple[MlaWeights, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weights = MlaWeights.random(SPARSE_MLA, gen, torch.float64)
    x_a = torch.randn(12, SPARSE_MLA.hidden_size, generator=gen, dtype=torch.float64)
    x_b = torch.randn(20, SPARSE_MLA.hidden_size, generator=gen, dtype=torch.float64)
    return weights, x_a, x_b


MLA_STEPS = (  # (sequence, start, stop) chunks per step; step 1 mixes a prefill and a decode
    (("b", 0, 16),),
    (("a", 0, 12), ("b", 16, 17)),
    (("b", 17, 20),),
)


def _mla_rows(chunks) -> tuple[torch.Tensor, torch.Tensor, AttentionRows]:
    tables = {"a": list(range(0, 8)), "b": list(range(8, 16))}
    names = [name for name, start, stop in chunks for _ in range(start, stop)]
    positions = torch.tensor([p for _, start, stop in chunks for p in range(start, stop)])
    rows = AttentionRows(positions, torch.tensor([tables[n] for n in names]), BLOCK_SIZE)
    return positions, torch.tensor([n == "a" for n in names]), rows


def sparse_mla_steps(dcp: DcpGroup) -> dict[str, torch.Tensor]:
    """Sparse MLA over MLA_STEPS; also the gathered query rows of the mixed step."""
    weights, x_a, x_b = mla_inputs()
    caches = MlaCaches.empty(SPARSE_MLA, num_blocks=16, block_size=BLOCK_SIZE, dtype=torch.float64)
    outs, gathered, slots = [], torch.empty(0), torch.empty(0)
    for step, chunks in enumerate(MLA_STEPS):
        positions, is_a, rows = _mla_rows(chunks)
        x = torch.where(is_a.unsqueeze(1), x_a[positions.clamp(max=11)], x_b[positions])
        if step == 1:
            scratch = MlaCaches.empty(
                SPARSE_MLA, num_blocks=16, block_size=BLOCK_SIZE, dtype=torch.float64
            )
            slots = rows.slots(dcp)
            q = prepare_rows(
                weights,
                SPARSE_MLA,
                x,
                positions=positions,
                slots=slots,
                caches=scratch,
                heads=dcp.head_slice(SPARSE_MLA.num_heads),
            )
            gathered = all_gather_heads(torch.cat([q.q_nope, q.q_pe], dim=-1), dcp)
        outs.append(mla_attention(weights, SPARSE_MLA, x, rows=rows, caches=caches, dcp=dcp))
    return {"out": torch.cat(outs), "gathered_queries": gathered, "slots": slots}


def greedy_tokens(dcp: DcpGroup) -> dict[str, dict[str, list[int]]]:
    return {
        name: run_scenario(TinyDecoder(cfg, seed=MODEL_SEED), dcp, DecodeScenario())
        for name, cfg in MODELS.items()
    }


def no_rows(dcp: DcpGroup) -> tuple[int, ...]:
    """A step with no query rows: nothing to write, attend or merge, and no collective hangs."""
    shape = (4, BLOCK_SIZE, KV_HEADS, DIM)
    k_cache, v_cache = torch.zeros(shape), torch.zeros(shape)
    rows = AttentionRows(
        torch.zeros(0, dtype=torch.long), torch.zeros(0, 1, dtype=torch.long), BLOCK_SIZE
    )
    q, kv = torch.zeros(0, HEADS, DIM), torch.zeros(0, KV_HEADS, DIM)
    out = dcp_attention(q, kv, kv, k_cache=k_cache, v_cache=v_cache, rows=rows, dcp=dcp, scale=1.0)
    return tuple(out.shape)


def all_checks(dcp: DcpGroup) -> dict[str, object]:
    """Everything one rank contributes, with interleave 1 and 2 for the attention steps."""
    interleaved = DcpGroup(dcp.rank, dcp.world_size, 2, dcp.process_group)
    return {
        "gqa_i1": gqa_attention_steps(dcp),
        "gqa_i2": gqa_attention_steps(interleaved),
        "sparse_mla": sparse_mla_steps(dcp),
        "tokens": greedy_tokens(dcp),
        "no_rows": no_rows(dcp),
    }


def fail_on_rank_one(dcp: DcpGroup) -> int:
    """Rank 1 raises; the others block in a collective that can never complete."""
    if dcp.rank == 1:
        raise ValueError("rank 1 gives up")
    dist.all_reduce(torch.ones(1))
    return dcp.rank


def run_engine_jobs(dcp: DcpGroup, jobs: dict[str, object]) -> dict[str, object]:
    """Each named DcpJob on the same group, in turn (rank 0's outcomes; None elsewhere)."""
    from hybridserve.offline.runtime import DcpJob, run_dcp_job

    outcomes = {}
    for name, job in jobs.items():
        assert isinstance(job, DcpJob)
        outcomes[name] = run_dcp_job(dcp, job)
    return outcomes


def report_ready(dcp: DcpGroup, failing_rank: int) -> str:
    """Every rank confirms its start; `failing_rank` reports a failure. Returns what was raised."""
    from hybridserve.executor.torch.dcp import confirm_ready

    failure = "could not load the model" if dcp.rank == failing_rank else None
    try:
        confirm_ready(dcp, failure)
    except RuntimeError as exc:
        return str(exc)
    return "started"
