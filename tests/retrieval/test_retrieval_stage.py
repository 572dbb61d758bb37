"""Retrieval as a stage of the audit (issue 9, item 1): it runs ahead of evaluation in a background thread, pool by
pool, so agents evaluate the first pool's cases while later pools are still embedded; texts the embedding cache lacks
can be embedded by Ray actors, which start only when a text is missing and give the in-process vectors."""

from __future__ import annotations

import hashlib
import threading
import time

import numpy as np
import polars as pl
import pytest

from pipeline.agents.reader import ReaderAgent
from pipeline.audit.run import AuditConfig, InputSpec, audit, run_audit
from pipeline.audit.worker import AgentWorker
from pipeline.exec.pools import LocalPool
from pipeline.exec.prefetch import Prefetch
from pipeline.retrieval.embeddings import (
    CHUNK_TEXTS,
    DIM,
    EmbedWorker,
    MiniLMEncoder,
    PoolEncoder,
)

needs_minilm = pytest.mark.skipif(not MiniLMEncoder.available(), reason="dense extra not installed")


def test_prefetch_yields_in_order_then_raises_the_producers_error_where_it_happened():
    def source():
        yield 1
        yield 2
        raise ValueError("pool p3: broken")

    feed = Prefetch(source(), ahead=1)
    assert feed.get() == 1 and feed.get() == 2
    with pytest.raises(ValueError, match="pool p3"):
        feed.get()
    assert feed.get() is Prefetch.DONE


def test_prefetch_runs_ahead_by_at_most_its_bound_and_close_stops_the_producer():
    made = []

    def source():
        for i in range(1000):
            made.append(i)
            yield i

    feed = Prefetch(source(), ahead=3)
    time.sleep(0.3)
    assert len(made) <= 3 + 2  # the queue's items, one being put, one produced and waiting
    assert feed.get() == 0
    feed.close()
    n = len(made)
    time.sleep(0.3)
    assert len(made) == n < 1000 and not feed._thread.is_alive()


def test_prefetch_without_a_thread_produces_lazily_in_order():
    made = []

    def source():
        for i in range(3):
            made.append(i)
            yield i

    feed = Prefetch(source(), ahead=2, thread=False)
    assert made == [] and feed.get() == 0 and made == [0]
    assert feed.get(block=False) == 1 and feed.get() == 2 and feed.get() is Prefetch.DONE


def test_prefetch_get_without_blocking_says_empty_while_the_producer_works():
    gate = threading.Event()

    def source():
        gate.wait(5)
        yield "a"

    feed = Prefetch(source(), ahead=2)
    assert feed.get(block=False) is Prefetch.EMPTY
    gate.set()
    assert feed.get() == "a" and feed.get() is Prefetch.DONE


class _GatedEncoder:
    """A stand-in embedder (a unit test of the driver, the caller): vectors from text hashes; the call that embeds the
    last pool waits until an agent has evaluated a case, which only a driver that evaluates while retrieval is still
    running can bring about (otherwise the wait times out and the audit fails)."""

    def __init__(self, evaluated: threading.Event, last_pool_text: str):
        self.evaluated, self.last_pool_text, self.waited = evaluated, last_pool_text, None

    def encode(self, texts, progress=False):
        if self.last_pool_text in texts:
            self.waited = self.evaluated.wait(timeout=60)
            if not self.waited:
                raise TimeoutError("no case was evaluated while the last pool was being embedded")
        out = np.empty((len(texts), DIM), dtype=np.float32)
        for i, t in enumerate(texts):
            rng = np.random.default_rng(int.from_bytes(hashlib.sha256(t.encode()).digest()[:8], "little"))
            v = rng.normal(size=DIM)
            out[i] = v / np.linalg.norm(v)
        return out


class _SignallingWorker(AgentWorker):
    def __init__(self, spec, agent, evaluated: threading.Event):
        super().__init__(spec, agent)
        self.evaluated = evaluated

    def run_cases(self, tasks, settings):
        out = super().run_cases(tasks, settings)
        self.evaluated.set()
        return out


class _ActorLikePool(LocalPool):
    """A pool whose worker stands for actors in other processes: the driver then runs retrieval in its own thread
    (with a truly in-process agent it retrieves lazily in the driver's thread, see `pipeline.audit.driver`)."""

    in_process = False


@needs_minilm
def test_evaluation_starts_while_later_pools_are_still_being_embedded(tmp_path, monkeypatch):
    monkeypatch.setenv("MECLEAR_CACHE", str(tmp_path / "cache"))  # cold: every text goes to the encoder
    pools, queries, files = InputSpec().load()
    last_pool = list(dict.fromkeys(q.pool_id for q in queries))[-1]
    evaluated = threading.Event()
    encoder = _GatedEncoder(evaluated, pools[last_pool].memories[0].text)
    cfg = AuditConfig(executor="local", dense="on")
    agent = ReaderAgent()
    pool = _ActorLikePool(_SignallingWorker(cfg.agent_spec, agent, evaluated))
    result = run_audit(pools, queries, cfg, tmp_path / "out", pool, agent.fingerprint(), files, progress=False,
                       encoder=lambda: encoder)
    assert encoder.waited is True and result.cases == len(queries) and result.failed == 0
    assert result.timings["retrieval_texts_embedded"] > 0 and result.timings["retrieval_encoder_started"] == 1
    assert 0 < result.timings["first_case_s"] < result.timings["evaluate_s"]


@needs_minilm
def test_pool_encoder_gives_the_in_process_vectors():
    # more texts than one chunk, of varied lengths, so chunks and batches differ from input order
    texts = [f"memory {i}: " + "word " * (i % 37) + f"ends {i * 7919 % 1000}" for i in range(CHUNK_TEXTS + 150)]
    local = MiniLMEncoder().encode(texts)
    pooled = PoolEncoder(LocalPool(EmbedWorker()), MiniLMEncoder().model_id).encode(texts)
    assert pooled.shape == local.shape == (len(texts), DIM)
    # the same batches (sorted by length then text, whole batches per chunk), so the same vectors
    assert np.abs(pooled - local).max() < 1e-6


def _contexts(out) -> list[dict]:
    df = pl.read_parquet(out / "contexts").drop("run_id")
    return df.sort(["pool_id", "query_id", "position"]).to_dicts()


@needs_minilm
@pytest.mark.ray
def test_embedding_actors_fill_the_cache_once_and_a_warm_rerun_starts_none(ray_session, tmp_path, monkeypatch):
    monkeypatch.setenv("MECLEAR_CACHE", str(tmp_path / "cache-actors"))
    cfg = AuditConfig(executor="ray", actors=1, embed_actors=1, dense="on", utility="correct")
    cold = audit(InputSpec(), cfg, tmp_path / "cold", progress=False)
    assert cold.timings["retrieval_texts_embedded"] > 0 and cold.timings["retrieval_encoder_started"] == 1
    warm = audit(InputSpec(), cfg, tmp_path / "warm", progress=False)
    assert warm.timings["retrieval_texts_embedded"] == 0 and warm.timings["retrieval_encoder_started"] == 0
    # the driver-embedded contexts (own cold cache) are the actor-embedded ones
    monkeypatch.setenv("MECLEAR_CACHE", str(tmp_path / "cache-driver"))
    local = audit(InputSpec(), AuditConfig(executor="local", dense="on", utility="correct"), tmp_path / "local",
                  progress=False)
    assert local.timings["retrieval_texts_embedded"] == cold.timings["retrieval_texts_embedded"]
    assert _contexts(tmp_path / "cold") == _contexts(tmp_path / "warm") == _contexts(tmp_path / "local")


def test_embed_actors_need_the_ray_executor():
    from pipeline.core.errors import ConfigError

    with pytest.raises(ConfigError, match="embed_actors=2 needs executor 'ray'"):
        AuditConfig(executor="local", embed_actors=2)
