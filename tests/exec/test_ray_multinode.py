"""A real multi-node Ray cluster (issue 17, item 7): agent actors on two nodes, the worker node removed mid-run; the
run completes by itself, every coalition exactly once, and its outputs equal an undisturbed run's.

The cluster (`ray.cluster_utils.Cluster`, head + one worker node on this machine) runs in a process of its own
(tests/exec/multinode_audit.py) with a private RAY_TMPDIR, so it never meets the session's Ray (`ray_session`) or
another cluster on the machine, and is gone when that process ends."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import polars as pl
import pytest

from tests.audit.test_resume_and_out import KEY, _assert_same_outputs

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]


def test_worker_node_removed_mid_run_completes_with_the_undisturbed_outputs(tmp_path, sample_audit):
    whole = sample_audit.run(batch_size=32)  # the undisturbed run, in process (multinode_audit.py's settings)
    counts = sample_audit.counts(batch_size=32)
    out, report = tmp_path / "multinode", tmp_path / "facts.json"
    ray_tmp = tempfile.mkdtemp(prefix="mc-ray-")  # short: Ray's socket paths must stay under 107 characters
    env = os.environ | {"PYTHONPATH": str(ROOT), "RAY_TMPDIR": ray_tmp, "RAY_USAGE_STATS_ENABLED": "0",
                        "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    try:
        script = Path(__file__).with_name("multinode_audit.py")
        proc = subprocess.run([sys.executable, str(script), str(out), str(report)],
                              env=env, capture_output=True, timeout=300)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    facts = json.loads(report.read_text())
    assert set(facts["nodes_at_start"]) == {facts["head"], facts["worker"]}  # actors on both nodes
    assert facts["removed_with_inflight"] >= 1 and facts["done_before_removal"][1] >= 1  # removed mid-run
    assert facts["nodes_at_end"] == [facts["head"], facts["head"]]  # actor 1 restarted on the head
    assert facts["alive_nodes"] == 1
    assert facts["failed"] == 0 and facts["cases"] == counts["cases"]
    util = pl.read_parquet(out / "utilities")
    assert facts["evaluated"] == util.height == counts["coalitions_evaluated"]  # each coalition exactly once
    assert util.select(KEY).is_duplicated().sum() == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["utilities"]["rows"] == counts["coalitions_evaluated"]
    _assert_same_outputs(out, whole)
