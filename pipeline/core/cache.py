"""Where MeClear keeps what it derives and can rebuild (text embeddings, converted GGUF models)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """The user cache folder: $MECLEAR_CACHE, else ~/.cache/meclear."""
    return Path(os.environ.get("MECLEAR_CACHE") or Path.home() / ".cache" / "meclear")
