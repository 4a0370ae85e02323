"""Replays of block-hash traces through the KV cache alone (`hybridserve cache-replay`)."""
