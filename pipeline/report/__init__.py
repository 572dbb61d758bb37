"""The audit report: one self-contained HTML page per run (pool summary, per-query games, night-over-night trends),
and the same page for `meclear eval` results. `meclear report RUN_DIR` is the entry point (pipeline/cli/report.py)."""
