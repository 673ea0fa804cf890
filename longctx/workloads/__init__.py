"""Offline workloads: the RULER long-context suite (`longctx ruler`) and repository retrieval
(`longctx retrieve`), against the embedded engine or any OpenAI-compatible server."""
