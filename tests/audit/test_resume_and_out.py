"""Nightly safety: a driver killed with SIGKILL resumes to exactly the undisturbed outputs, reruns converge, --reuse
evaluates only what changed, output folders are locked and never take foreign files, data failures go to errors/."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest

from pipeline.audit.run import sample_paths
from pipeline.cli.main import main
from tests.audit.test_audit_local import audit

ROOT = Path(__file__).resolve().parents[2]
REDUCTIONS = ("contexts", "attributions", "interactions", "clearances")
KEY = ["pool_id", "query_id", "context_hash", "coalition", "agent", "utility_mode"]

DYING_DRIVER = """
import os, signal, sys
from pipeline.agents.reader import ReaderAgent
from pipeline.audit.run import AuditConfig
from pipeline.audit.run import InputSpec
from pipeline.audit.run import run_audit
from pipeline.audit.worker import AgentWorker
from pipeline.exec.pools import LocalPool

class Dying(ReaderAgent):
    batches = 0
    def answer_batch(self, requests):
        Dying.batches += 1
        if Dying.batches > int(sys.argv[2]):
            os.kill(os.getpid(), signal.SIGKILL)  # the driver dies mid-evaluation, no cleanup of any kind
        return super().answer_batch(requests)

pools, queries, files = InputSpec().load()
cfg = AuditConfig(executor="local", dense="off", utility="correct", batch_size=32)
agent = Dying()
run_audit(pools, queries, cfg, sys.argv[1], LocalPool(AgentWorker(cfg.agent_spec, agent)),
          agent.fingerprint(), files, progress=False, flush_rows=1)
"""


def _frame(out: Path, name: str) -> pl.DataFrame:
    df = pl.read_parquet(out / name).drop("run_id")  # run_id keys the settings, which include the executor
    return df.sort(df.columns) if name != "utilities" else df.sort(KEY)


def _assert_same_outputs(a: Path, b: Path) -> None:
    for name in REDUCTIONS:
        assert _frame(a, name).equals(_frame(b, name)), name
    cols = [*KEY, "utility", "correct", "answer"]
    assert _frame(a, "utilities").select(cols).equals(_frame(b, "utilities").select(cols))


def test_driver_killed_mid_evaluation_resumes_to_the_undisturbed_outputs(tmp_path, sample_audit):
    whole = sample_audit.run(utility="correct", batch_size=32)  # the undisturbed run (DYING_DRIVER's settings)
    evaluated = sample_audit.counts(utility="correct", batch_size=32)["coalitions_evaluated"]
    out = tmp_path / "killed"
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", DYING_DRIVER, str(out), "12"], env=env, capture_output=True,
                          timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    on_disk = pl.read_parquet(out / "utilities").height
    assert 0 < on_disk < evaluated
    assert json.loads((out / "manifest.json").read_text())["status"] == "running"  # never mistaken for complete
    assert (out / ".meclear.lock").exists()  # left by the dead driver: stale, taken over below

    second, agent = audit(tmp_path, "killed", utility="correct", batch_size=32)
    assert second.evaluated == evaluated - on_disk == sum(agent.calls.values())  # only what was missing
    util = pl.read_parquet(out / "utilities")
    assert util.height == evaluated and util.select(KEY).is_duplicated().sum() == 0  # each coalition once
    assert len(list((out / "utilities").glob("*.parquet"))) == 1  # compacted
    _assert_same_outputs(out, whole)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["utilities"]["rows"] == evaluated
    assert not (out / ".meclear.lock").exists()

    third, agent3 = audit(tmp_path, "killed", utility="correct", batch_size=32)
    assert third.evaluated == 0 and sum(agent3.calls.values()) == 0 and third.reused == evaluated


def test_partial_then_full_run_converges(tmp_path):
    """The issue's reproduction: --max-queries 10 then all queries into one --out keeps every row of both runs."""
    out = tmp_path / "o"
    args = ["audit", "--out", str(out), "--executor", "local", "--dense", "off", "--no-progress"]
    assert main([*args, "--max-queries", "10"]) == 0
    first = pl.read_parquet(out / "utilities").height
    assert main(args) == 0
    util = pl.read_parquet(out / "utilities")
    assert util.height == 36 * 32 and util["query_id"].n_unique() == 36 and first == 10 * 32
    assert util.select(KEY).is_duplicated().sum() == 0


def _copy_sample(folder: Path) -> tuple[Path, Path]:
    folder.mkdir(parents=True)
    mem, qry = sample_paths()
    return Path(shutil.copy(mem, folder / "memories.jsonl")), Path(shutil.copy(qry, folder / "queries.jsonl"))


def test_reuse_evaluates_nothing_unchanged_and_only_the_queries_of_a_changed_memory(tmp_path, capsys):
    mem, qry = _copy_sample(tmp_path / "in")
    base = ["audit", "--memories", str(mem), "--queries", str(qry), "--executor", "local", "--dense", "off",
            "--no-progress", "--utility", "correct"]
    assert main([*base, "--out", str(tmp_path / "night1")]) == 0
    assert main([*base, "--out", str(tmp_path / "night2"), "--reuse", str(tmp_path / "night1")]) == 0
    m2 = json.loads((tmp_path / "night2" / "manifest.json").read_text())["counts"]
    assert (m2["coalitions_evaluated"] == 0
            and m2["coalitions_reused"] == m2["coalitions_imported_from_reuse"] == 36 * 32)
    _assert_same_outputs(tmp_path / "night1", tmp_path / "night2")

    # change one memory's text: only the queries whose frozen context holds it are evaluated again
    lines = mem.read_text().splitlines()
    rec = json.loads(lines[0])
    rec["text"] += " (edited)"
    lines[0] = json.dumps(rec)
    mem.write_text("\n".join(lines) + "\n")
    assert main([*base, "--out", str(tmp_path / "night3"), "--reuse", str(tmp_path / "night2")]) == 0
    ctx = pl.read_parquet(tmp_path / "night3" / "contexts")
    touched = ctx.filter(pl.col("memory_id") == rec["memory_id"]).select("pool_id", "query_id").unique()
    assert touched.height >= 1
    util = pl.read_parquet(tmp_path / "night3" / "utilities")
    m3 = json.loads((tmp_path / "night3" / "manifest.json").read_text())["counts"]
    assert m3["coalitions_evaluated"] == 32 * touched.height
    assert util.height == 36 * 32 and util.select(KEY).is_duplicated().sum() == 0


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


HOLDER = """
import sys, time
from pipeline.store.lock import OutLock
OutLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(60)
"""


def test_second_run_into_a_locked_out_exits_2_at_once(tmp_path, capsys):
    out = tmp_path / "o"
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = _tree(out)
        rc = main(["audit", "--out", str(out), "--executor", "local", "--dense", "off", "--no-progress"])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and len(err.splitlines()) == 1 and f"in use by pid {holder.pid}" in err
        assert _tree(out) == before
    finally:
        holder.kill()
        holder.wait()
    # its owner gone (killed: no cleanup), the lock file stays but nobody holds it: the next run takes it over
    assert (out / ".meclear.lock").exists()
    assert main(["audit", "--out", str(out), "--executor", "local", "--dense", "off", "--no-progress"]) == 0
    assert not (out / ".meclear.lock").exists()


@pytest.mark.parametrize("foreign", ["notes.txt", "manifest.json", "contexts/notes.txt"])
def test_out_with_foreign_files_is_refused_and_untouched(tmp_path, capsys, foreign):
    out = tmp_path / "o"
    (out / foreign).parent.mkdir(parents=True)
    (out / foreign).write_text("{\"mine\": 1}")
    before = _tree(out)
    rc = main(["audit", "--out", str(out), "--executor", "local", "--dense", "off", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "--out" in err, err
    assert _tree(out) == before and sorted(os.listdir(out)) == sorted(os.listdir(out))


def test_non_finite_utilities_go_to_errors_and_the_run_finishes_non_zero(tmp_path, capsys, monkeypatch):
    # An agent that answers NaN probabilities for coalitions of 3 or more memories. (`--agent-option beta=.inf` once
    # did this; agent options must now be finite, so that is exit 2 before any work,
    # tests/cli/test_bad_input_catalogue.py.)
    from pipeline.agents.base import AgentResponse
    from pipeline.agents.reader import ReaderAgent

    answer = ReaderAgent._answer
    monkeypatch.setattr(ReaderAgent, "_answer", lambda self, req: AgentResponse(
        (float("nan"),) * len(req.options), "") if len(req.memories) >= 3 else answer(self, req))
    out = tmp_path / "o"
    rc = main(["audit", "--out", str(out), "--executor", "local", "--dense", "off", "--no-progress",
               "--max-queries", "6"])
    assert rc == 3
    errors = pl.read_parquet(out / "errors")
    assert errors.height > 0 and set(errors["kind"]) == {"non_finite_utility"}
    cl = pl.read_parquet(out / "clearances")
    assert cl.height + errors["query_id"].n_unique() == 6
    assert pl.read_parquet(out / "utilities")["utility"].is_finite().all()
    assert json.loads((out / "manifest.json").read_text())["status"] == "complete_with_errors"


SLOW_CLI = """
import sys, time
from pathlib import Path
from pipeline.agents.reader import ReaderAgent
from pipeline.cli.main import main

answer = ReaderAgent.answer_batch
ReaderAgent.answer_batch = lambda self, requests: (time.sleep(0.2), answer(self, requests))[1]
ReaderAgent.close = lambda self: Path(sys.argv[2]).write_text("closed")
sys.exit(main(["audit", "--out", sys.argv[1], "--executor", "local", "--dense", "off", "--batch-size", "32"]))
"""


def test_ctrl_c_closes_the_agent_releases_the_lock_and_exits_130(tmp_path):
    out, marker = tmp_path / "o", tmp_path / "closed"
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", SLOW_CLI, str(out), str(marker)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (out / "manifest.json").exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(1.0)  # mid-evaluation: the whole run takes 36 cases x 0.2 s at least
    assert proc.poll() is None
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert err.strip().splitlines()[-1] == "meclear: interrupted; agents shut down"
    assert marker.read_text() == "closed" and not (out / ".meclear.lock").exists()
    assert json.loads((out / "manifest.json").read_text())["status"] == "running"


def test_an_agent_error_on_one_query_goes_to_errors_and_the_rest_finish(tmp_path):
    from pipeline.agents.reader import ReaderAgent
    from pipeline.audit.run import AuditConfig, InputSpec, run_audit
    from pipeline.audit.worker import AgentWorker
    from pipeline.exec.pools import LocalPool

    class FailsOnOne(ReaderAgent):
        def answer_batch(self, requests):
            if any("allergic" in r.question for r in requests):
                raise ValueError("cannot answer\nsecond line")
            return super().answer_batch(requests)

    pools, queries, files = InputSpec().load()
    cfg = AuditConfig(executor="local", dense="off", utility="correct", batch_size=64)
    agent = FailsOnOne()
    result = run_audit(pools, queries, cfg, tmp_path / "o", LocalPool(AgentWorker(cfg.agent_spec, agent)),
                       agent.fingerprint(), files, progress=False)
    failing = {q.query_id for q in queries if "allergic" in q.question}
    errors = pl.read_parquet(tmp_path / "o" / "errors")
    assert result.failed == len(failing) >= 1 and set(errors["query_id"]) == failing
    assert set(errors["kind"]) == {"agent_error"} and (errors["reason"] == "ValueError: cannot answer").all()
    assert pl.read_parquet(tmp_path / "o" / "clearances").height == 36 - len(failing)
