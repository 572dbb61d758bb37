"""Headless Chromium for the report tests: screenshots and the DOM after scripts ran. Skips when it is absent."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it: apt-get install -y chromium)")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--virtual-time-budget=5000"]  # let the page's async work (gzip unpacking of a figure) finish


def _run(args: list[str], timeout: int = 90) -> str:
    """Run chromium in its own process group; on timeout the whole group (browser, zygote, renderers) is killed."""
    with tempfile.TemporaryDirectory(prefix="meclear-chromium-") as profile:
        proc = subprocess.Popen([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
        assert proc.returncode == 0, f"chromium exited with {proc.returncode}"
        return out


def dump_dom(url: str, timeout: int = 90) -> str:
    return _run(["--dump-dom", url], timeout)


def screenshot(url: str, png: Path, size: str = "1280,1800") -> Path:
    _run([f"--screenshot={png}", f"--window-size={size}", url])
    assert png.is_file(), f"chromium wrote no screenshot for {url}"
    return png
