"""The data order of a resumed run: each epoch's order drawn from the seed and the epoch alone."""

from __future__ import annotations

from collections.abc import Sized
from typing import cast

import torch


class EpochSeededSampler(torch.utils.data.Sampler):
    """TRL's ``RepeatSampler`` (or any sampler with a seeded ``generator``) whose epoch ``e`` draws the order an
    uninterrupted run draws in epoch ``e``, also when the run was resumed.

    ``RepeatSampler`` seeds its generator once and advances it by one shuffle per epoch; a checkpoint does not store
    the generator, so a resumed run starts again from the seed and replays epoch 0's order (or, resumed within a
    later epoch, skips the first batches of the wrong order: some prompts twice, others never). ``Trainer`` calls
    ``set_epoch(e)`` before every epoch (through accelerate's data loader); this resets the generator to the seed
    and advances it by ``e`` shuffles of the wrapped sampler, exactly as ``e`` uninterrupted epochs did.

    Example:
        >>> from trl.trainer.utils import RepeatSampler
        >>> def order(sampler, epoch):
        ...     sampler.set_epoch(epoch)
        ...     return list(sampler)
        >>> uninterrupted = EpochSeededSampler(RepeatSampler(range(6), mini_repeat_count=1, seed=0))
        >>> orders = [order(uninterrupted, e) for e in range(3)]
        >>> resumed = EpochSeededSampler(RepeatSampler(range(6), mini_repeat_count=1, seed=0))
        >>> order(resumed, 2) == orders[2] != orders[0]
        True
    """

    def __init__(self, sampler: torch.utils.data.Sampler):
        self.sampler = sampler
        generator = getattr(sampler, "generator", None) if getattr(sampler, "shuffle", True) else None
        self._generator: torch.Generator | None = generator
        self._seed = 0 if generator is None else generator.initial_seed()  # read only with a generator

    def set_epoch(self, epoch: int) -> None:
        if self._generator is None:
            return
        self._generator.manual_seed(self._seed)
        for _ in range(epoch):
            for _ in self.sampler:  # one epoch's draws, whatever the wrapped sampler draws per epoch
                pass

    def __iter__(self):
        return iter(self.sampler)

    def __len__(self) -> int:
        return len(cast(Sized, self.sampler))  # TypeError for a sampler without a length, as Trainer expects
