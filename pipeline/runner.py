"""Glue shared by the CLI and the Ray jobs: what to read, then load -> start agents -> audit -> stop agents.

Inputs are loaded and validated before the output folder is created, so bad input writes nothing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from pipeline.audit import AuditConfig, AuditResult, run_audit
from pipeline.configs import check, from_mapping
from pipeline.errors import ConfigError
from pipeline.io.loaders import input_files, load_pools, load_queries
from pipeline.io.locomo import load_locomo
from pipeline.io.records import Pool, Query

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
    mem0: tuple[str, ...] = ()  # mem0 export files (user_id = pool); queries still come from `queries`

    def __post_init__(self) -> None:
        w = "inputs"
        object.__setattr__(self, "memories", tuple(self.memories))
        object.__setattr__(self, "queries", tuple(self.queries))
        object.__setattr__(self, "conversations", tuple(self.conversations))
        object.__setattr__(self, "mem0", tuple(self.mem0))
        check(not (self.locomo and (self.memories or self.queries or self.mem0)), w,
              "give either locomo or memories/mem0 + queries, not both")
        check(not (self.memories and self.mem0), w, "give either memories or mem0, not both")
        check(bool(self.memories or self.mem0) == bool(self.queries), w,
              "memories (or mem0) and queries must be given together")
        check(self.max_queries >= 0, w, f"max_queries={self.max_queries}; must be >= 0")
        check(self.locomo_options == 0 or self.locomo_options >= 2, w, "locomo_options must be 0 (open answers) or >= 2")

    @property
    def is_sample(self) -> bool:
        return not self.locomo and not self.memories and not self.mem0

    def load(self) -> tuple[dict[str, Pool], list[Query], list[str]]:
        """(pools, queries, files read). Raises InputError on the first malformed record."""
        if self.locomo:
            pools, queries = load_locomo(self.locomo, self.locomo_options, conversations=list(self.conversations) or None)
            files = [self.locomo]
        elif self.mem0:
            from pipeline.io.mem0 import load_mem0

            pools = load_mem0(self.mem0)
            queries = load_queries(self.queries, pools)
            files = [*self.mem0, *(str(f) for p in self.queries for f in input_files(p))]
        else:
            mem, qry = (self.memories, self.queries) if self.memories else tuple(map(lambda p: (str(p),), sample_paths()))
            pools = load_pools(mem)
            queries = load_queries(qry, pools)
            files = [str(f) for p in (*mem, *qry) for f in input_files(p)]
        if self.max_queries:
            queries = queries[: self.max_queries]
        return pools, queries, files


def build_executor(config: AuditConfig):
    if config.executor == "local":
        from pipeline.executors import LocalExecutor

        return LocalExecutor(config.agent_spec, config.utility)
    from pipeline.ray_exec import RayExecutor

    return RayExecutor(config.agent_spec, config.utility, config.actors, config.cpus_per_actor, config.gpus_per_actor)


def audit(inputs: InputSpec, config: AuditConfig, out: str | Path, progress: bool = True) -> AuditResult:
    """Load and validate inputs, start agents (Ray actors unless executor='local'), run the audit, stop agents."""
    pools, queries, files = inputs.load()
    log.info("loaded %d pools, %d queries", len(pools), len(queries))
    started_ray = False
    t = time.perf_counter()
    if config.executor == "ray":
        from pipeline.ray_exec import init_ray

        started_ray = init_ray()
    executor = build_executor(config)
    startup = time.perf_counter() - t
    try:
        result = run_audit(pools, queries, config, out, executor, executor.fingerprint, files, progress)
    finally:
        executor.close()
        if started_ray:
            import ray

            ray.shutdown()
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

    import yaml

    try:
        raw = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"job config {path}: does not exist") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"job config {path}: not valid YAML ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"job config {path}: must be a mapping with keys inputs, audit, out")
    unknown = sorted(set(raw) - {"inputs", "audit", "out"})
    if unknown:
        raise ConfigError(f"job config {path}: unknown key(s) {unknown}; allowed ['audit', 'inputs', 'out']")
    if "out" not in raw:
        raise ConfigError(f"job config {path}: 'out' (the run folder) is required")
    inputs = from_mapping(InputSpec, raw.get("inputs"), f"job config {path}: inputs")
    audit_cfg = from_mapping(AuditConfig, raw.get("audit"), f"job config {path}: audit")
    out = str(raw["out"]).format(date=datetime.date.today().isoformat())
    return JobConfig(inputs, audit_cfg, out)
