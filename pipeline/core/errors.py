"""Small named errors. Each message says what was wrong, where it came from, and what is allowed."""

from __future__ import annotations


class MeClearError(Exception):
    """Base class of every error this package raises on purpose."""

    exit_code = 1


class InputError(MeClearError):
    """A malformed input record: names the file, the line (JSONL) or row (Parquet) and the field."""

    exit_code = 2

    def __init__(self, path: str, where: str, field: str | None, problem: str):
        self.path, self.where, self.field, self.problem = str(path), where, field, problem
        loc = f"{self.path}:{where}" if where else self.path
        fld = f"field '{field}' " if field else ""
        super().__init__(f"{loc}: {fld}{problem}")


class ConfigError(MeClearError):
    """An invalid configuration value or an unknown key."""

    exit_code = 2


class AgentError(MeClearError):
    """An agent could not be built or returned an unusable answer."""


class AgentStartError(AgentError):
    """An agent could not be built from its settings (bad option, missing model, engine refused the settings)."""

    exit_code = 2


class EngineDeadError(AgentError):
    """The agent's engine died (vLLM's EngineDeadError, CUDA out of memory, a CUDA fault): no later case can be answered
    by this agent, so this is not a case-level error. Inside a Ray actor the actor exits and Ray restarts it and retries
    its task (`pipeline.audit.worker.AgentWorker`); in process the run stops here and a rerun resumes it."""

    exit_code = 4


class EndpointGoneError(AgentError):
    """The agent's server (the openai agent's endpoint) stopped answering: connection refused or reset, timeouts, or
    429/5xx on every retry. No later case can be answered either, so this is not a case-level error; and unlike an
    engine death, restarting the actor does not help (the server is outside the run). The run stops, every part already
    written stays, and a rerun once the server is back resumes from there."""

    exit_code = 4


class MissingDependencyError(MeClearError):
    """An optional dependency is not installed; the message carries the install hint."""

    exit_code = 2


class OutputError(MeClearError):
    """An output folder that cannot or must not be written: an input, foreign files, in use by another run."""

    exit_code = 2


class ResourceError(MeClearError):
    """The cluster cannot satisfy the resources the run asks for."""

    exit_code = 2


# Exit codes of `meclear` and the jobs: 0 done; 1 an unexpected failure (a bug: traceback); 2 bad input, settings or
# output folder (one line, nothing written), and a full disk (one line; the whole parts written stay, a rerun resumes);
# 3 finished, but some cases failed for a data reason (see errors/); 4 the agent's engine died in process
# (`--executor local`; rerun to resume) or its server stopped answering (any executor; rerun to resume); 130
# interrupted (Ctrl-C); 143 SIGTERM, 129 SIGHUP (128 + the signal: `pipeline.core.signals`); in every stopped case
# the agents are shut down and the lock released.
EXIT_CASE_ERRORS = 3
EXIT_DISK_FULL = 2
EXIT_INTERRUPTED = 130
