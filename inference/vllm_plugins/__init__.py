"""Modules vLLM imports inside its own server process (this directory goes on its PYTHONPATH)."""
