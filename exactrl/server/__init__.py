"""OpenAI-compatible HTTP server over the engine, with token-exact multi-turn chat (see app.py)."""
