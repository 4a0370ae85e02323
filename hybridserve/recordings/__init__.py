"""Differential replay against recorded vLLM scheduler decisions (`vllm-sched-trace/1`)."""
