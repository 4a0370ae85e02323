"""hybridserve: an LLM serving engine core for hybrid models under prefill pressure."""

__version__ = "0.1.0"
