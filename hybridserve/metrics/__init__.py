"""Request and job metrics: TTFT, ITL, E2E, job goodput, percentiles."""
