"""Where tests find data that the project does not ship: LoCoMo lives in ../shared beside the checkout (CI lays a copy
there too); MECLEAR_LOCOMO overrides it."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCOMO = Path(os.environ.get("MECLEAR_LOCOMO", REPO.parent / "shared" / "data" / "locomo" / "locomo10.json"))
