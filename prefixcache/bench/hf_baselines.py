"""What a user would run instead: HF transformers on the same weights, threads and prompts.

Three variants, all greedy, each request producing exactly ``max_tokens`` tokens
(``min_new_tokens = max_new_tokens``; note that this masks EOS where our ``ignore_eos`` keeps it, so
outputs can differ after an EOS):

- ``no_reuse``: one ``generate`` per request, sequentially, nothing reused.
- ``prefix_copy``: the reuse transformers' docs recommend ("Re-use cache to continue generation"):
  prefill a ``DynamicCache`` for the prompts' common token prefix once, then ``copy.deepcopy`` it
  for each request and ``generate`` the rest. The one-off prefix prefill counts in the wall time;
  each request's TTFT includes its deep copy.
- ``batched``: one ``generate`` per round with every prompt of the round left-padded.

TTFT is measured with a streamer: ``generate`` hands it the prompt, then each new token.
:meth:`HFBaselines.timed_generate` and :meth:`HFBaselines.prefill_prefix` are the pieces the speed
workload (:mod:`prefixcache.bench.speed`) times one request at a time with.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.generation.streamers import BaseStreamer

from prefixcache.bench.accounting import common_prefix_len

VARIANTS = ("no_reuse", "prefix_copy", "batched")


class _FirstTokenClock(BaseStreamer):
    """Records when ``generate`` emits its first new token (its second ``put``) and its last one."""

    def __init__(self) -> None:
        self.num_puts = 0
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None

    def put(self, value) -> None:
        self.num_puts += 1
        if self.num_puts >= 2:
            self.last_token_s = time.perf_counter()
            if self.num_puts == 2:
                self.first_token_s = self.last_token_s

    def end(self) -> None:
        pass


@dataclass
class HFRun:
    """One variant's run over all rounds.

    Attributes:
        variant: one of :data:`VARIANTS`.
        wall_s: seconds for the whole workload.
        num_output_tokens: tokens generated.
        ttft_s: per request, seconds from the request's start to its first token (``None`` for
            ``batched``, where one call serves a whole round).
        output_token_ids: per request, in round order.
        shared_prefix_tokens: ``prefix_copy`` only: tokens prefilled once and copied.
    """

    variant: str
    wall_s: float
    num_output_tokens: int
    ttft_s: list[float] = field(default_factory=list)
    output_token_ids: list[list[int]] = field(default_factory=list)
    shared_prefix_tokens: int = 0

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self) -> dict:
        return {
            "variant": self.variant,
            "wall_s": self.wall_s,
            "output_tokens_per_s": self.output_tokens_per_s,
            "ttft_median_s": statistics.median(self.ttft_s) if self.ttft_s else None,
            "ttft_p90_s": _p90(self.ttft_s) if self.ttft_s else None,
            "shared_prefix_tokens": self.shared_prefix_tokens,
        }


def _p90(xs: Sequence[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(0.9 * (len(s) - 1)))]


def load_hf_model(model_dir: Path):
    """The same checkpoint as ours, fp32, eval mode."""
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


class HFBaselines:
    """Runs the three variants on one HF model.

    Args:
        hf_model: a causal LM from :func:`load_hf_model`.
        pad_token_id: the id used for padding (an EOS id of the model).
        num_threads: torch CPU threads, the same as our engine's.
    """

    def __init__(self, hf_model, pad_token_id: int, num_threads: int) -> None:
        self.model = hf_model
        self.pad_token_id = pad_token_id
        self.num_threads = num_threads

    def _generate(self, ids: torch.Tensor, mask: torch.Tensor, max_tokens: int, **kw) -> torch.Tensor:
        return self.model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
            do_sample=False, pad_token_id=self.pad_token_id, **kw,
        )

    def run(self, variant: str, rounds: Sequence[Sequence[list[int]]], max_tokens: int) -> HFRun:
        """Runs one variant over the rounds (requests of a round in order, rounds in order).

        Raises:
            ValueError: unknown variant.
        """
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        torch.set_num_threads(self.num_threads)
        with torch.inference_mode():
            return getattr(self, f"_{variant}")(rounds, max_tokens)

    def _no_reuse(self, rounds, max_tokens: int) -> HFRun:
        run = HFRun("no_reuse", 0.0, 0)
        self._one_by_one(run, [p for r in rounds for p in r], max_tokens, time.perf_counter(), None)
        return run

    def timed_generate(self, prompt: list[int], max_tokens: int,
                       prefix_cache: DynamicCache | None = None) -> tuple[list[int], float, float]:
        """One greedy ``generate`` of exactly ``max_tokens`` tokens (from a deep copy of
        ``prefix_cache`` when given, which must hold a prefix of ``prompt``).

        Returns:
            (output token ids, TTFT in seconds, seconds to the last token), both timed from before
            the deep copy.
        """
        ids = torch.tensor([prompt])
        clock = _FirstTokenClock()
        t0 = time.perf_counter()
        kw = {"cache": copy.deepcopy(prefix_cache)} if prefix_cache is not None else {}
        out = self._generate(ids, torch.ones_like(ids), max_tokens, streamer=clock, **kw)
        return out[0, len(prompt):].tolist(), clock.first_token_s - t0, clock.last_token_s - t0

    def prefill_prefix(self, prefix: list[int]) -> DynamicCache:
        """A ``DynamicCache`` holding ``prefix``'s K/V (one forward pass).

        Raises:
            RuntimeError: the cache does not hold exactly ``len(prefix)`` tokens.
        """
        cache = DynamicCache(config=self.model.config)
        self.model(torch.tensor([prefix]), cache=cache, use_cache=True)
        if cache.get_seq_length() != len(prefix):
            raise RuntimeError(f"prefix cache holds {cache.get_seq_length()} tokens, expected {len(prefix)}")
        return cache

    def _one_by_one(self, run: HFRun, prompts, max_tokens: int, start: float, prefix_cache) -> None:
        """Generates each prompt alone (from a copy of ``prefix_cache`` when given) into ``run``."""
        for prompt in prompts:
            output_ids, ttft_s, _ = self.timed_generate(prompt, max_tokens, prefix_cache)
            run.ttft_s.append(ttft_s)
            run.output_token_ids.append(output_ids)
        run.wall_s = time.perf_counter() - start
        run.num_output_tokens = sum(len(o) for o in run.output_token_ids)

    def _prefix_copy(self, rounds, max_tokens: int) -> HFRun:
        prompts = [p for r in rounds for p in r]
        # generate needs at least one uncached token per prompt.
        n_prefix = min(common_prefix_len(prompts), min(len(p) for p in prompts) - 1)
        run = HFRun("prefix_copy", 0.0, 0, shared_prefix_tokens=max(n_prefix, 0))
        start = time.perf_counter()
        prefix_cache = self.prefill_prefix(prompts[0][:n_prefix]) if n_prefix > 0 else None
        self._one_by_one(run, prompts, max_tokens, start, prefix_cache)
        return run

    def _batched(self, rounds, max_tokens: int) -> HFRun:
        run = HFRun("batched", 0.0, 0)
        start = time.perf_counter()
        for prompts in rounds:
            width = max(len(p) for p in prompts)
            ids = torch.tensor([[self.pad_token_id] * (width - len(p)) + list(p) for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            out = self._generate(ids, mask, max_tokens)
            run.output_token_ids.extend(out[:, width:].tolist())
        run.wall_s = time.perf_counter() - start
        run.num_output_tokens = sum(len(o) for o in run.output_token_ids)
        return run
