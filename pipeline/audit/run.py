"""The public entry of an audit: inputs checked -> agents started -> the driver -> outputs.

`audit` is what the CLI and the Ray jobs call: inputs, the agent's options and the output folder are all checked, and
the folder locked, before any agent starts or anything is written, so a bad input writes nothing and a second run into
a locked folder fails at once. The driver itself (`run_audit`) lives in `pipeline.audit.driver`; `AuditConfig` holds
every setting of an audit, `InputSpec` says where the memories and queries come from, `load_job_config` reads a job's
YAML.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Iterator

from pipeline.agents import AgentSpec, checked_spec
from pipeline.audit.driver import AuditResult, run_audit
from pipeline.audit.settings import AuditConfig
from pipeline.audit.worker import AgentWorker, agent_fingerprint
from pipeline.core.errors import ConfigError, OutputError
from pipeline.core.extras import require_audit
from pipeline.core.validation import check, from_mapping
from pipeline.core.yamlconf import MAX_BYTES as MAX_YAML_BYTES
from pipeline.core.yamlconf import load_yaml
from pipeline.exec.pools import LocalPool, WorkerPool
from pipeline.io.loaders import input_files, load_pools, load_queries
from pipeline.io.locomo import load_locomo
from pipeline.io.records import MAX_MEMORY_CHARS, MAX_OPTIONS, Pool, Query
from pipeline.store.lock import OutLock
from pipeline.store.outdir import check_out, check_real_folder

log = logging.getLogger(__name__)

def sample_paths() -> tuple[Path, Path]:
    """The bundled sample pool (our own text) and its queries."""
    root = resources.files("pipeline") / "data" / "sample"
    return Path(str(root / "memories.jsonl")), Path(str(root / "queries.jsonl"))


@dataclass(frozen=True)
class InputSpec:
    """Where the memories and queries come from: JSONL/Parquet files, LoCoMo, or (neither given) the sample pool."""

    memories: tuple[str, ...] = ()
    queries: tuple[str, ...] = ()
    locomo: str | None = None
    conversations: tuple[str, ...] = ()
    locomo_options: int = 4
    max_queries: int = 0  # 0 = all
    max_memory_chars: int = MAX_MEMORY_CHARS  # longer memory texts are input errors
    mem0: tuple[str, ...] = ()  # mem0 export files (user_id = pool); queries still come from `queries`

    def __post_init__(self) -> None:
        w = "inputs"
        for name in ("memories", "queries", "conversations", "mem0"):
            value = getattr(self, name)
            if isinstance(value, str):  # one path given as a string, not its characters
                value = (value,)
            check(isinstance(value, (list, tuple)) and all(isinstance(v, str) and v for v in value), w,
                  f"{name} must be a path or a list of paths, got {value!r}")
            object.__setattr__(self, name, tuple(value))
        check(self.locomo is None or isinstance(self.locomo, str), w, f"locomo must be a path, got {self.locomo!r}")
        for name in ("max_queries", "locomo_options", "max_memory_chars"):
            v = getattr(self, name)
            check(isinstance(v, int) and not isinstance(v, bool), w, f"{name}={v!r}; must be an integer")
        check(self.max_memory_chars >= 1, w, f"max_memory_chars={self.max_memory_chars}; must be >= 1")
        check(not (self.locomo and (self.memories or self.queries or self.mem0)), w,
              "give either locomo or memories/mem0 + queries, not both")
        check(not (self.memories and self.mem0), w, "give either memories or mem0, not both")
        check(bool(self.memories or self.mem0) == bool(self.queries), w,
              "memories (or mem0) and queries must be given together")
        check(self.max_queries >= 0, w, f"max_queries={self.max_queries}; must be >= 0")
        check(self.locomo_options == 0 or 2 <= self.locomo_options <= MAX_OPTIONS, w,
              f"locomo_options={self.locomo_options}; must be 0 (open answers) or 2..{MAX_OPTIONS}")

    @property
    def is_sample(self) -> bool:
        return not self.locomo and not self.memories and not self.mem0

    def load(self) -> tuple[dict[str, Pool], list[Query], list[str]]:
        """(pools, queries, files read). Raises InputError on the first malformed record."""
        if self.locomo:
            pools, queries = load_locomo(self.locomo, self.locomo_options, max_chars=self.max_memory_chars,
                                         conversations=list(self.conversations) or None)
            files = [self.locomo]
        elif self.mem0:
            from pipeline.io.mem0 import load_mem0

            pools = load_mem0(self.mem0, self.max_memory_chars)
            queries = load_queries(self.queries, pools)
            files = [*self.mem0, *(str(f) for p in self.queries for f in input_files(p))]
        else:
            mem, qry = ((self.memories, self.queries) if self.memories
                        else tuple(map(lambda p: (str(p),), sample_paths())))
            pools = load_pools(mem, self.max_memory_chars)
            queries = load_queries(qry, pools)
            files = [str(f) for p in (*mem, *qry) for f in input_files(p)]
        if self.max_queries:
            queries = queries[: self.max_queries]
        return pools, queries, files


@contextmanager
def agents_running(config: AuditConfig, spec: AgentSpec) -> Iterator[tuple[WorkerPool, str]]:
    """Start the agents: one in this process (executor 'local') or a pool of Ray actors (starting or joining Ray).
    Yields (pool, the agents' fingerprint); stops them, and Ray if this started it, also on Ctrl-C."""
    if config.executor == "local":
        pool: WorkerPool = LocalPool(AgentWorker(spec))
        try:
            yield pool, agent_fingerprint(pool.call_all("fingerprint"))
        finally:
            pool.close()
        return
    from pipeline.audit.actors import EMBED_CPUS, start_agent_pool
    from pipeline.exec.ray_pool import cluster_session

    with cluster_session():
        pool, fp = start_agent_pool(spec, config.actors, config.cpus_per_actor, config.gpus_per_actor,
                                    reserve_cpus=config.embed_actors * EMBED_CPUS)
        try:
            yield pool, fp
        finally:
            pool.close()


def _embed_actors(config: AuditConfig):
    """What starts the embedding actors (`--embed-actors N`, Ray only) when the cache first lacks a text, or None."""
    if config.executor != "ray" or not config.embed_actors:
        return None
    from pipeline.audit.actors import start_embed_pool

    return lambda: start_embed_pool(config.embed_actors)


def audit(inputs: InputSpec, config: AuditConfig, out: str | Path, progress: bool = True,
          reuse: list[str] | tuple[str, ...] = ()) -> AuditResult:
    """Load and validate inputs and the agent's options, check and lock `out`, start agents, run the audit (the
    driver, `pipeline.audit.driver.run_audit`), stop agents (also on Ctrl-C), release the lock."""
    pools, queries, files = inputs.load()
    log.info("loaded %d pools, %d queries", len(pools), len(queries))
    spec = checked_spec(config.agent, config.agent_options)  # one line, before Ray or an engine starts
    # missing extras are one line here, before a local Ray starts (issue 17): on a cluster (RAY_ADDRESS) the agents'
    # packages are the workers' image's, not the driver's
    require_audit(config.agent, spec.options.get("model"), config.dense,
                  agents_here=config.executor == "local" or not os.environ.get("RAY_ADDRESS"))
    out = Path(out)
    check_real_folder("--out", out)
    seen: dict[Path, str] = {out.resolve(): f"--out {out}"}
    for r in reuse:
        if Path(r).resolve() in seen:  # resolved: `R`, `./R/` and a link to R are one folder
            other = seen[Path(r).resolve()]
            hint = ("a rerun into --out already resumes from it, drop --reuse" if other.startswith("--out")
                    else "give each --reuse folder once")
            raise OutputError(f"--reuse {r}: is the same folder as {other}; {hint}")
        seen[Path(r).resolve()] = f"--reuse {r}"
        if not (Path(r) / "utilities").is_dir():
            raise OutputError(f"--reuse {r}: has no utilities/ folder; give an earlier run's --out")
    reuse_dirs = list(reuse)
    # every file and folder the run reads: --out may neither hold one nor sit inside one
    # the folders given as inputs are recorded too: a later `curate --out` must not drop a file into a memory bank's
    # folder, where the next audit would read it as memories
    folders = [d for d in (*inputs.memories, *inputs.queries, *inputs.mem0) if Path(d).is_dir()]
    check_out(out, [*files, *inputs.memories, *inputs.queries, *inputs.mem0, *filter(None, [inputs.locomo]),
                    *reuse_dirs])
    with OutLock(out) as lock:
        t = time.perf_counter()
        with agents_running(config, spec) as (agents, fingerprint):
            startup = time.perf_counter() - t
            result = run_audit(pools, queries, config, out, agents, fingerprint, files + folders, progress,
                               reuse_dirs, lock, encoder=_embed_actors(config))
    result.timings["agents_startup_s"] = startup
    return result


@dataclass(frozen=True)
class JobConfig:
    """A YAML job file: `inputs` (InputSpec keys), `out` (may contain {date}), `audit` (AuditConfig keys)."""

    inputs: InputSpec
    audit: AuditConfig
    out: str


def load_job_config(path: str | Path) -> JobConfig:
    import datetime

    p = Path(path)
    if p.exists() and not p.is_file() and not p.is_dir():  # reading a FIFO would block for good
        raise ConfigError(f"job config {path}: is not a regular file (a FIFO, socket or device); give the YAML file")
    try:
        if p.is_file() and p.stat().st_size > MAX_YAML_BYTES:  # refused before it is read at all
            raise ConfigError(f"job config {path}: is {p.stat().st_size:,} bytes; the limit is {MAX_YAML_BYTES:,}")
        data = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"job config {path}: does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"job config {path}: is a folder; give the YAML file") from None
    raw = load_yaml(data, f"job config {path}")
    if not isinstance(raw, dict):
        raise ConfigError(f"job config {path}: must be a mapping with keys inputs, audit, out")
    unknown = sorted(set(raw) - {"inputs", "audit", "out"})
    if unknown:
        raise ConfigError(f"job config {path}: unknown key(s) {unknown}; allowed ['audit', 'inputs', 'out']")
    if "out" not in raw:
        raise ConfigError(f"job config {path}: 'out' (the run folder) is required")
    for key in ("inputs", "audit"):
        if raw.get(key) is not None and not isinstance(raw[key], dict):
            raise ConfigError(f"job config {path}: {key} must be a mapping of settings, got {type(raw[key]).__name__}")
    if not isinstance(raw["out"], str) or not raw["out"].strip():
        raise ConfigError(f"job config {path}: out must be a folder path (text; may contain {{date}})")
    inputs = from_mapping(InputSpec, raw.get("inputs"), f"job config {path}: inputs")
    audit_cfg = from_mapping(AuditConfig, raw.get("audit"), f"job config {path}: audit")
    try:
        out = raw["out"].format(date=datetime.date.today().isoformat())
    except (KeyError, IndexError, ValueError) as exc:
        raise ConfigError(f"job config {path}: out {raw['out']!r} has an unknown placeholder ({exc}); "
                          "allowed: {date}") from None
    return JobConfig(inputs, audit_cfg, out)


__all__ = ["AuditConfig", "AuditResult", "InputSpec", "JobConfig", "audit", "agents_running", "load_job_config",
           "run_audit", "sample_paths"]
