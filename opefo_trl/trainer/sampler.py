"""The data order of a resumed run: each epoch's order drawn from the seed and the epoch alone."""

from __future__ import annotations

from typing import Any

import torch
from transformers import TrainerCallback


def restart_at_epoch(sampler: torch.utils.data.Sampler, epoch: int) -> None:
    """Put a sampler with a seeded ``generator`` (TRL's ``RepeatSampler``) where an uninterrupted run has it at the
    start of ``epoch``: the generator reset to its seed and advanced by ``epoch`` epochs' draws. A sampler that does
    not shuffle, or has no generator, is left as it is.

    Example:
        >>> from trl.trainer.utils import RepeatSampler
        >>> uninterrupted = RepeatSampler(range(6), mini_repeat_count=1, seed=0)
        >>> orders = [list(uninterrupted) for epoch in range(3)]
        >>> resumed = RepeatSampler(range(6), mini_repeat_count=1, seed=0)  # a restart: the sampler is new
        >>> restart_at_epoch(resumed, 2)
        >>> list(resumed) == orders[2] != orders[0]
        True
    """
    generator = getattr(sampler, "generator", None) if getattr(sampler, "shuffle", True) else None
    if not isinstance(generator, torch.Generator):
        return
    generator.manual_seed(generator.initial_seed())
    for _ in range(epoch):
        for _ in sampler:  # one epoch's draws, whatever the sampler draws per epoch
            pass


def train_sampler(dataloader: Any) -> torch.utils.data.Sampler | None:
    """The sampler under a (possibly accelerate-prepared) training data loader, or None (an iterable data set): the
    batch sampler's ``sampler``, through accelerate's batch-sampler wrappers (``BatchSamplerShard`` on several
    processes, ``SkipBatchSampler`` on resume), which hold the wrapped one as ``batch_sampler``."""
    batches = getattr(dataloader, "batch_sampler", None)
    while batches is not None and getattr(batches, "sampler", None) is None:
        batches = getattr(batches, "batch_sampler", None)
    return getattr(batches, "sampler", None)


class EpochSeededOrder(TrainerCallback):
    """Each epoch draws the order an uninterrupted run draws in that epoch, also when the run was resumed.

    TRL's ``RepeatSampler`` seeds its generator once and advances it by one shuffle per epoch; a checkpoint does not
    store the generator, so a resumed run starts again from the seed and replays epoch 0's order (or, resumed within
    a later epoch, skips the first batches of the wrong order: some prompts twice, others never). At the start of
    every epoch (before ``Trainer`` iterates the data loader, and before a resume skips the trained batches) this
    restarts the sampler at that epoch (:func:`restart_at_epoch`). The epoch is ``state.epoch``'s whole part: the
    epochs trained so far, as a checkpoint's ``trainer_state.json`` holds them.
    """

    def on_epoch_begin(self, args, state, control, train_dataloader=None, **kwargs):
        sampler = train_sampler(train_dataloader)
        if sampler is not None:
            restart_at_epoch(sampler, int(state.epoch or 0))
