"""The OpenAI-compatible HTTP front end (FastAPI on rank 0)."""
