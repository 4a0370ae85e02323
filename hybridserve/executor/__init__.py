"""Executors: the only thing the engine knows about execution is the Executor protocol."""
