"""Simulator: GPU cost model, simulated executor, event loop, workloads and traces."""
