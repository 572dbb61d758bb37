"""Frozen retrieval: BM25, MiniLM embeddings with their cache, reciprocal-rank fusion."""
