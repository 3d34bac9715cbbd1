"""Requests, batching, KV cache, sampling. Knows nothing about where an expert runs."""
