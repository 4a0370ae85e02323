"""OpenAI-compatible serving: the FastAPI app, the async engine loop, tokenizers, metrics."""
