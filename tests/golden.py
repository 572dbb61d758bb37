"""Golden outputs that pin behaviour across restructurings (issue 10): the rows of `meclear audit` on the sample pool
and of a reduced `meclear eval`, canonicalised (volatile columns dropped, rows sorted, floats rounded to 1e-9).

Regenerate only when a change of behaviour is intended, and say so in the commit:
    python tests/golden.py --write
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import polars as pl

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "fixtures" / "golden"
REPO = HERE.parent
sys.path.insert(0, str(REPO))  # run as a script (`python tests/golden.py --write`), `tests` is imported from here
from tests.data_paths import LOCOMO  # noqa: E402

# Columns that legitimately differ between two runs of the same inputs: identifiers of the run, clocks, cache hits.
VOLATILE = {"run_id", "latency_s", "cached_tokens", "agent"}
AUDIT_DATASETS = ("contexts", "utilities", "attributions", "interactions", "clearances")
AUDIT_ARGS = ["audit", "--executor", "local", "--dense", "off", "--no-progress"]
EVAL_ARGS = ["eval", "--locomo", str(LOCOMO), "--conversations", "conv-26", "--max-cases", "2", "--replicates", "50",
             "--executor", "local", "--dense", "off", "--agent", "reader", "--seed", "0", "--no-progress"]


SUMMARY_KEYS = ("metrics", "fault_positions", "excluded", "n_cases", "cases", "agent_calls", "n_scored_cases")


def _canonical(value):
    if isinstance(value, float):
        return round(value, 9)
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    return value


def canonical_rows(frame: pl.DataFrame) -> list[dict]:
    frame = frame.drop([c for c in frame.columns if c in VOLATILE])
    rows = [_canonical(r) for r in frame.to_dicts()]
    return sorted(rows, key=lambda r: json.dumps(r, sort_keys=True, default=str))


def run_cli(args: list[str], out: Path) -> None:
    cmd = [sys.executable, "-m", "pipeline.cli.main", *args, "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-4000:]}")


def audit_rows(out: Path) -> dict[str, list[dict]]:
    run_cli(AUDIT_ARGS, out)
    return {name: canonical_rows(pl.read_parquet(out / name)) for name in AUDIT_DATASETS}


def eval_rows(out: Path) -> dict[str, list[dict]]:
    run_cli(EVAL_ARGS, out)
    summary = json.loads((out / "summary.json").read_text())
    kept = {k: _canonical(summary[k]) for k in SUMMARY_KEYS}
    return {"cases": canonical_rows(pl.read_parquet(out / "cases.parquet")), "summary": kept}


def load(name: str) -> dict:
    return json.loads((GOLDEN / f"{name}.json").read_text())


if __name__ == "__main__":
    import tempfile

    if sys.argv[1:] != ["--write"]:
        sys.exit(__doc__)
    with tempfile.TemporaryDirectory() as tmp:
        for name, make in (("audit", audit_rows), ("eval", eval_rows)):
            rows = make(Path(tmp) / name)
            (GOLDEN / f"{name}.json").write_text(json.dumps(rows, indent=0, sort_keys=True, default=str) + "\n")
            print(f"wrote {GOLDEN / f'{name}.json'}")
