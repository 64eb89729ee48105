"""log pi_t and H_t of the sampled tokens (and the surprise-gap moments S_2, S_3), taken from the logits
transformers' ``generate`` computes anyway.

A rollout batch of several micro-batches needs the policy's log pi_t and H_t of every token before the first
backward; without TRL's own old-log-prob pass (strict on-policy, no vLLM), that would be a no-grad forward over the
whole rollout. Generation has already computed every position's logits at the same parameters: :class:`GenerationStats`
reads them with a forward hook on the policy while it generates (one [B, V] block kept at a time, not the
[B, T, V] logits ``output_logits`` would keep), at the training temperature, and pairs each with the token sampled from
it (the next step's input; the last one from the completions). A forward counts as a generation step when it carries a
key-value cache (``CACHE_ARGUMENTS``); TRL's scoring passes carry none.

Generation and teacher-forced scoring differ only by rounding (a KV cache and other kernels): on the tiny test
model log pi_t agreed to ~1e-6 and lambda* to ~1e-7 (tests/trainer/test_generation_stats.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from opefo_trl.trainer.batch_state import Scores

#: The keyword a generation step passes its key-value cache as (transformers 5: ``cache``; earlier ``past_key_values``).
CACHE_ARGUMENTS = ("cache", "past_key_values")


class GenerationStats:
    """Records, while the policy generates, log pi and H of each sampled token at ``temperature`` (with ``vocab``,
    also the surprise-gap moments S_2, S_3 of ``VocabStats.moments``)."""

    def __init__(self, temperature: float, vocab: bool = False):
        self.temperature, self.vocab = temperature, vocab
        self._logps: list[torch.Tensor] = []
        self._entropies: list[torch.Tensor] = []
        self._sums: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._pending: torch.Tensor | None = None  # the last step's log-softmax, awaiting its sampled token
        self._in_step = False

    @contextmanager
    def recording(self, model: torch.nn.Module) -> Iterator[GenerationStats]:
        self._logps, self._entropies, self._sums, self._pending = [], [], [], None
        handles = [
            model.register_forward_pre_hook(self._before, with_kwargs=True),
            model.register_forward_hook(self._after, with_kwargs=True),
        ]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _before(self, module: Any, args: tuple, kwargs: dict) -> None:
        self._in_step = any(kwargs.get(name) is not None for name in CACHE_ARGUMENTS)
        ids = kwargs.get("input_ids", args[0] if args else None)
        if self._in_step and self._pending is not None and ids is not None:
            self._pair(ids[:, -1])  # a decoding step's input: the token sampled from the previous step's logits

    @torch.no_grad()
    def _after(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        if self._in_step and getattr(output, "logits", None) is not None:
            self._pending = torch.log_softmax(output.logits[:, -1].float() / self.temperature, dim=-1)
        self._in_step = False

    def _pair(self, tokens: torch.Tensor) -> None:
        assert self._pending is not None
        logp = self._pending
        probs = logp.exp()
        self._logps.append(logp.gather(-1, tokens[:, None].to(logp.device))[:, 0])
        entropy = -(probs * logp).sum(-1)
        self._entropies.append(entropy)
        if self.vocab:
            weighted_gap = probs.square() * (logp + entropy[:, None])  # pi^2 (log pi + H), then pi^3 (...)
            moment2 = weighted_gap.sum(-1)
            self._sums.append((moment2, weighted_gap.mul_(probs).sum(-1)))
        self._pending = None

    def scores(self, completion_ids: torch.Tensor) -> Scores | None:
        """log pi_t and H_t of ``completion_ids`` (B, T), or None when the recorded steps do not cover them (more
        than one generate call, another batch layout)."""
        steps = len(self._logps) + (self._pending is not None)
        batch, length = completion_ids.shape
        if steps < length or length == 0 or (self._logps and len(self._logps[0]) != batch):
            return None
        if self._pending is not None and len(self._logps) < length:
            self._pair(completion_ids[:, len(self._logps)])  # the last step's token: no further step read it
        device = completion_ids.device
        logps, entropies = torch.stack(self._logps[:length], 1), torch.stack(self._entropies[:length], 1)
        vocab: list[torch.Tensor | None] = [None, None]
        if self.vocab:
            vocab = [torch.stack(sums, 1).to(device) for sums in zip(*self._sums[:length], strict=True)]
        self._logps, self._entropies, self._sums, self._pending = [], [], [], None
        return Scores(logps.to(device), entropies.to(device), *vocab)
