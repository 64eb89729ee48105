"""Where a policy's entropy sits: on the tokens the task is answered in, or on tokens it never rewards.

A policy can keep its mean token entropy while its answers stop being right, by moving probability onto tokens the
task never rewards (letters and control characters among the digits of the demo's task). ``measure_placement``
samples completions of the held-out prompts from the current policy (in a forked random stream: the run's own stream
is left as it was) and scores them with one full-vocabulary forward in float64:

- ``entropy``: the mean token entropy over the whole vocabulary;
- ``task_entropy``: the mean entropy of the policy renormalised over the task's tokens (how the policy spreads over
  the answers it could give);
- ``off_task_probability``: the mean probability of the tokens outside the task's set;
- ``off_task_sampled``: the share of sampled tokens outside it.

``PlacementCallback`` takes these every ``every`` optimizer steps and at the start, and adds them to the run's
``log_history`` as ``placement/<name>``.

Example (a policy that writes digits only, with probability mass elsewhere):
    >>> import torch
    >>> logits = torch.tensor([[[2.0, 0.0, 0.0, -1.0]]]); ids = torch.tensor([[0]]); mask = torch.tensor([[True]])
    >>> p = placement_of(logits, ids, mask, task_tokens=torch.tensor([0, 1]))
    >>> round(p["off_task_probability"], 4), p["off_task_sampled"], round(p["task_entropy"], 4)
    (0.1402, 0.0, 0.3653)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import TrainerCallback

from opefo_trl.demo.evaluate import sample_completions

PREFIX = "placement/"
NAMES = ("entropy", "task_entropy", "off_task_probability", "off_task_sampled")


def placement_of(
    logits: torch.Tensor, completion_ids: torch.Tensor, mask: torch.Tensor, task_tokens: torch.Tensor
) -> dict[str, float]:
    """The four means over the completion positions in ``mask`` (B, T), from the logits (B, T, V) that predicted
    ``completion_ids``."""
    logp = torch.log_softmax(logits.double(), -1)
    p = logp.exp()
    entropy = -(p * logp).sum(-1)
    task = torch.log_softmax(logits.double()[..., task_tokens], -1)
    task_entropy = -(task.exp() * task).sum(-1)
    off_task_probability = 1 - p[..., task_tokens].sum(-1)
    off_task_sampled = (~torch.isin(completion_ids, task_tokens)).double()
    count = mask.sum().clamp(min=1)
    return {
        name: float((value * mask).sum() / count)
        for name, value in zip(NAMES, (entropy, task_entropy, off_task_probability, off_task_sampled), strict=True)
    }


@torch.no_grad()
def measure_placement(
    model,
    tokenizer,
    prompts: Sequence[list[dict]],
    task_tokens: torch.Tensor,
    samples: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
) -> dict[str, float]:
    """``samples`` completions of each prompt (``sample_completions``), scored by one forward; the policy's random
    stream is left as it was."""
    prompt_mask, output = sample_completions(model, tokenizer, prompts, samples, max_new_tokens, temperature, seed)
    was_training = model.training
    model.eval()
    try:
        completion_ids = output[:, prompt_mask.shape[1] :]
        # The sampled tokens up to and including the first end of turn (generate pads after it).
        ended = (completion_ids == tokenizer.eos_token_id).long().cumsum(1)
        mask = (ended == 0) | ((ended == 1) & (completion_ids == tokenizer.eos_token_id))
        attention = torch.cat([prompt_mask, mask.long()], 1)
        length = completion_ids.shape[1]
        logits = model(input_ids=output, attention_mask=attention).logits[:, -length - 1 : -1] / temperature
    finally:
        model.train(was_training)
    return placement_of(logits, completion_ids, mask, task_tokens.to(logits.device))


class PlacementCallback(TrainerCallback):
    """``measure_placement`` at the start and every ``every`` optimizer steps (and the last), into ``log_history``:
    the start as a row of its own at step 0, later ones into the step's logged row."""

    def __init__(self, tokenizer, prompts, task_tokens: torch.Tensor, every: int, **measure):
        self.tokenizer, self.prompts, self.task_tokens, self.every = tokenizer, prompts, task_tokens, every
        self.measure = measure

    def _measure(self, model) -> dict[str, float]:
        found = measure_placement(model, self.tokenizer, self.prompts, self.task_tokens, **self.measure)
        return {PREFIX + name: value for name, value in found.items()}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step == 0:
            state.log_history.append({"step": 0, **self._measure(model)})

    def on_log(self, args, state, control, model=None, logs=None, **kwargs):
        step, last = state.global_step, state.max_steps
        row = state.log_history[-1] if state.log_history else {}
        if "entropy" in (logs or {}) and row.get("step") == step and (step % self.every == 0 or step == last):
            row.update(self._measure(model))
