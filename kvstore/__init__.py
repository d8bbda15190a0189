"""kvstore: a storage engine and daemon for LLM KV-cache blocks."""

__version__ = "0.1.0"
