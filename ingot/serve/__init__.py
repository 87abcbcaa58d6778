"""`ingot serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) on the async engine."""
