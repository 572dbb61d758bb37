"""The output folder: what may be written where, and one run at a time.

`claim` refuses (OutputError, exit 2, nothing written) an `--out` that is an existing file, is not writable, is an
input or holds one, or holds files this tool did not write; then it takes `.meclear.lock` (created with O_EXCL, holding
the owner's pid, host and start time). A second run into the same folder fails at once; a lock whose owner is gone
(same host, pid not alive) is stale and taken over with a warning.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Iterable

from pipeline.errors import OutputError
from pipeline.store.lock import LOCK

log = logging.getLogger(__name__)

DATASET_NAMES = ("contexts", "utilities", "attributions", "interactions", "clearances", "errors")
OWN_FILES = {*DATASET_NAMES, "manifest.json", LOCK}


def _is_own(name: str) -> bool:
    """Names this tool writes: datasets, the manifest, the lock, and its temporary/staging/old siblings."""
    if name in OWN_FILES:
        return True
    if name.startswith(".") and name.endswith((".tmp", ".staging", ".old")):
        return name[1:].split(".", 1)[0] in OWN_FILES or name[1:].startswith("manifest.json")
    return False


def _inside(child: Path, parent: Path) -> bool:
    return child == parent or parent in child.parents


def check_out(out: Path, inputs: Iterable[str | Path]) -> None:
    """Every refusal of `out` that needs no lock. Raises OutputError with one line."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OutputError(f"--out {out}: is an existing file; give a folder")
    resolved = out.resolve()
    for p in inputs:
        rp = Path(p).resolve()
        if _inside(rp, resolved):
            raise OutputError(f"--out {out}: holds the input {p}; give a separate output folder")
    if out.is_dir():
        foreign = sorted(n for n in os.listdir(out) if not _is_own(n))
        foreign += sorted(f"{d}/{n}" for d in DATASET_NAMES if (out / d).is_dir() for n in os.listdir(out / d)
                          if not (n.endswith(".parquet") or (n.startswith(".") and n.endswith(".tmp"))))
        if foreign:
            more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
            raise OutputError(f"--out {out}: holds files meclear did not write ({foreign[0]!r}{more}); "
                              "give an empty or new folder")
        manifest = out / "manifest.json"
        if manifest.exists():
            try:
                ok = {"run_id", "datasets"} <= set(json.loads(manifest.read_text()))
            except (ValueError, OSError, TypeError):
                ok = False
            if not ok:
                raise OutputError(f"--out {out}: manifest.json was not written by meclear; give another folder")
    existing = next((p for p in [out, *out.parents] if p.exists()), Path("."))
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise OutputError(f"--out {out}: {existing} is not a writable folder")


def disk_full(exc: OSError) -> str | None:
    """The one line for a write that failed because the disk (or the user's quota) is full, or None for any other
    OSError. Arrow's writers raise OSError without an errno, so their message is read too. Every file reaches its
    final name only once whole (`pipeline.store.writer`), so what stays is whole; a rerun resumes from it."""
    import errno

    if exc.errno in (errno.ENOSPC, errno.EDQUOT) or "No space left on device" in str(exc) \
            or "Disk quota exceeded" in str(exc):
        where = f" writing {exc.filename}" if exc.filename else ""
        return (f"disk full{where}; free space (or give another --out) and rerun: whole parts already written are "
                "kept and the run resumes")
    return None
