"""The names of a run's summary numbers, shared by the paired experiments and the tables."""

from __future__ import annotations

# What one run reports (MetricsRecorder.summary and the simulator's additions).
RUN_KEYS = (
    "job_goodput_per_hour",
    "jobs_completed",
    "itl_p50_ms",
    "itl_p99_ms",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "prefix_hit_rate",
    "preemptions",
    "output_tokens_per_s",
    "tpot_mean_ms",
)
# Where the time went: GPU time by step kind, job time by phase, recomputation against ideal.
BREAKDOWN_KEYS = (
    "gpu_busy_frac",
    "gpu_decode_frac",
    "gpu_prefill_frac",
    "gpu_mixed_frac",
    "job_decode_frac",
    "job_tool_frac",
    "job_queue_ttft_frac",
    "recomputed_prompt_tokens_per_turn",
    "ideal_prompt_tokens_per_turn",
)
