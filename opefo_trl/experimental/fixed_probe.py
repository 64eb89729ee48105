"""A fixed probe for the `param` flow: completions of prompts the user sets aside, sampled once by the policy at the
start of training, whose mean token entropy the flow measures together with the rollout batch's
(``OPEFOTrainer(probe_dataset=...)``; docs/algorithm.md section 4, "A probe wider than the batch").

The completions are drawn by TRL's own generation path (its prompt tokenisation and ``_generate_single_turn``: the
training's sampling settings, vLLM included), ``num_generations`` per prompt, each process drawing for its share of the
prompts, under a fixed seed in a forked RNG so that the training's random stream is the one it would be without the
probe. TRL's colocate vLLM runs its engine in this process and samples from torch's default generator, so the seed
reaches vLLM's sampler too (tests/experimental/test_fixed_probe_vllm.py, on vLLM's CPU build). They are kept as token
ids, in micro-batches of the training's size, and re-scored under the current parameters at every estimate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from trl.trainer.utils import pad

from opefo_trl.trainer.batch_state import RolloutItem


class FixedProbe:
    """Args:
    prompts: the probe's prompts (a data set's ``prompt`` column: text or conversations).
    tokenize: TRL's ``_tokenize_prompts``; ``generate``: TRL's ``_generate_single_turn``.
    pad_token_id: the tokenizer's.
    num_generations: completions per prompt; ``batch_size``: completions per micro-batch.
    loss_mask: TRL's loss mask of a micro-batch (the tokens whose entropy counts).
    rank, world_size: this process's share of the prompts is ``prompts[rank::world_size]``.
    seed: of the sampling; ``device``: where the micro-batches live.
    """

    def __init__(
        self,
        prompts: Sequence[Any],
        tokenize: Callable[[list], tuple[list, Any, dict]],
        generate: Callable[..., tuple[list, Any]],
        pad_token_id: int,
        num_generations: int,
        batch_size: int,
        loss_mask: Callable[[dict], torch.Tensor],
        rank: int,
        world_size: int,
        seed: int,
        device: Callable[[], torch.device],
    ):
        if len(prompts) < world_size:
            raise ValueError(
                f"probe_dataset has {len(prompts)} prompts for {world_size} processes: every process samples its "
                "share of the probe. Give at least one prompt per process."
            )
        self.prompts = list(prompts)[rank::world_size]
        self.tokenize, self.generate, self.pad_token_id = tokenize, generate, pad_token_id
        self.num_generations, self.batch_size, self.loss_mask = num_generations, batch_size, loss_mask
        self.seed, self.device = seed, device
        self._batches: list[tuple[RolloutItem, torch.Tensor]] | None = None

    def batches(self) -> list[tuple[RolloutItem, torch.Tensor]]:
        """The probe's micro-batches and their loss masks (sampled on the first call)."""
        if self._batches is None:
            self._batches = self._sample()
        return self._batches

    @torch.no_grad()
    def _sample(self) -> list[tuple[RolloutItem, torch.Tensor]]:
        repeated = [prompt for prompt in self.prompts for _ in range(self.num_generations)]
        device = self.device()
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(self.seed)
            prompt_ids, images, multimodal = self.tokenize(repeated)
            if images is not None or multimodal:
                raise NotImplementedError("probe_dataset: the probe's scoring passes are text-only; give text prompts.")
            completion_ids, _ = self.generate(prompt_ids, None, {}, self.num_generations)
        pairs = []
        for start in range(0, len(repeated), self.batch_size):
            prompts = [torch.tensor(ids) for ids in prompt_ids[start : start + self.batch_size]]
            completions = [torch.tensor(ids) for ids in completion_ids[start : start + self.batch_size]]
            batch = {
                "prompt_ids": pad(prompts, padding_value=self.pad_token_id, padding_side="left"),
                "prompt_mask": pad([torch.ones_like(p) for p in prompts], padding_value=0, padding_side="left"),
                "completion_ids": pad(completions, padding_value=self.pad_token_id, padding_side="right"),
                "completion_mask": pad(
                    [torch.ones_like(c) for c in completions], padding_value=0, padding_side="right"
                ),
            }
            batch = {key: value.to(device) for key, value in batch.items()}
            advantages = torch.zeros(batch["completion_ids"].shape, device=device)  # outside the loss
            pairs.append((RolloutItem(batch, advantages), self.loss_mask(batch).float()))
        return pairs


def check_probe_dataset(dataset: Any, args: Any, needs_rollout_pass: bool) -> list | None:
    """The prompts of ``probe_dataset`` (None without one), refused before any model loads if the configuration
    computes no `param` flow or the data set has no prompts."""
    if dataset is None:
        return None
    if not ((needs_rollout_pass or args.entropy_flow_diagnostics) and args.entropy_flow_estimate == "param"):
        raise ValueError(
            "probe_dataset sets the entropy the 'param' estimate measures, but this configuration computes no "
            f"'param' flow (entropy_flow_estimate={args.entropy_flow_estimate!r}, method={args.method!r}, "
            f"entropy_flow_diagnostics={args.entropy_flow_diagnostics}). Set entropy_flow_estimate='param', or drop "
            "probe_dataset."
        )
    columns = getattr(dataset, "column_names", None)
    if not columns or "prompt" not in columns:
        raise ValueError(
            f"probe_dataset needs a 'prompt' column, as train_dataset has; its columns are {columns}. Give a "
            "datasets.Dataset of prompts never trained on."
        )
    if len(dataset) == 0:
        raise ValueError("probe_dataset has no rows; give at least one prompt per process.")
    return list(dataset["prompt"])
