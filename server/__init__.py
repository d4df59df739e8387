"""The bundled OpenAI-compatible vLLM server with a per-session KV cache (RAM + disk tiers).

Nothing heavy is imported here: vLLM and torch load inside `create_app`/the engine only.
"""
