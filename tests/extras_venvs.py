"""The extras' own venvs and the GPU extras' resolution (tests/e2e/test_extras.py), cached by pyproject hash, and their
build started in the background when a session that runs the `extras` tests is collected (tests/conftest.py).

Why in the background: building them is pip's work (downloads, unpacking), minutes on a fresh CI machine, while the
suite before tests/e2e/ is mostly CPU-bound engine work; under `nice` the builds fill the gaps, and the extras tests
at the end find them done. `wait_prebuild()` joins the background build before a test looks at the cache; whatever it
did not finish (or failed at) the test builds itself, in the foreground, with the error shown.

    python -m tests.extras_venvs test smollm2 gpu   # what the background build runs
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("MECLEAR_VENV_CACHE", Path.home() / ".cache" / "meclear-ci"))
# keyed by the project table only (dependencies and extras), so tool settings (ruff, pytest) keep the cache
KEY = hashlib.sha256(json.dumps(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"], sort_keys=True)
                     .encode()).hexdigest()[:16]
# A CPU machine's torch: the extras leave torch's version open (vLLM pins its own); this constraint keeps the CPU build.
CPU_TORCH = "torch==2.13.0\n"
GPU_SPEC = "gpu,dense,smollm2"  # resolved together: a solution for all three is a solution for every pair
VENVS = ("test", "smollm2")

_background: subprocess.Popen | None = None


def gpu_report() -> Path:
    return CACHE / f"extras-{KEY}" / "gpu-dense-smollm2.json"


def venv_dir(extra: str) -> Path:
    return CACHE / f"extras-{KEY}" / extra


def resolve_gpu() -> Path:
    """`pip install --dry-run` of `.[gpu,dense,smollm2]`; its report, kept per pyproject hash."""
    done = gpu_report()
    if done.exists():
        return done
    done.parent.mkdir(parents=True, exist_ok=True)
    partial = done.with_suffix(".partial")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                           "--report", str(partial), f"{ROOT}[{GPU_SPEC}]"], capture_output=True, text=True,
                          timeout=900, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"pip could not resolve .[{GPU_SPEC}]:\n{proc.stderr[-3000:]}")
    partial.replace(done)
    return done


def build_venv(extra: str) -> Path:
    """A venv with `extra`'s dependencies (not meclear itself: the checkout is put on PYTHONPATH, so a cached venv
    always runs the code under test), built once per pyproject hash; its python."""
    venv = venv_dir(extra)
    python = venv / "bin" / "python"
    if (venv / ".complete").exists():
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    (venv / "cpu-torch.txt").write_text(CPU_TORCH)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "-c", str(venv / "cpu-torch.txt"), f"{ROOT}[{extra}]"],
                   check=True, timeout=1800, cwd=ROOT)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", "meclear"], check=True)
    (venv / ".complete").touch()
    return python


def missing() -> list[str]:
    todo = [e for e in VENVS if not (venv_dir(e) / ".complete").exists()]
    return todo + ([] if gpu_report().exists() else ["gpu"])


def start_prebuild() -> None:
    """Start building what the cache lacks, in a niced background process (once per session)."""
    global _background
    todo = missing()
    if _background is not None or not todo:
        return
    log = CACHE / f"extras-{KEY}" / "prebuild.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(ROOT)}
    _background = subprocess.Popen(["nice", "-n", "19", sys.executable, "-m", "tests.extras_venvs", *todo],
                                   cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def wait_prebuild(timeout_s: float = 1800) -> None:
    """Join the background build, if one runs; its failures are left for the foreground build to show."""
    global _background
    if _background is not None:
        try:
            _background.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _background.kill()
            _background.wait()
        _background = None


def stop_prebuild() -> None:
    """At the session's end: a build still running (the extras tests were deselected or failed early) is stopped."""
    global _background
    if _background is not None and _background.poll() is None:
        _background.kill()
        _background.wait()
    _background = None


if __name__ == "__main__":
    failed = 0
    for what in sys.argv[1:]:
        try:
            print(resolve_gpu() if what == "gpu" else build_venv(what), flush=True)
        except Exception as exc:  # noqa: BLE001 - the next one may still build; the test shows this one's error
            print(f"{what}: {exc}", flush=True)
            failed = 1
    sys.exit(failed)
