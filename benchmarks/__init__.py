"""Throughput benchmarks of the audit pipeline's engines (speed and prefix-cache use, not answer quality).

The FI-LoCoMo quality benchmark is `pipeline.bench`; this package measures how fast coalitions go through the agents.
"""
