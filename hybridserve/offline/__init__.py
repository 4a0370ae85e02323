"""Offline generation on the torch executor (`runtime`): a checkpoint loaded into an Engine,
alone or on a decode-context-parallel group of ranks. `hybridserve generate` composes it."""
