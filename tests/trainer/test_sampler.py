"""opefo_trl.trainer.sampler: a resumed run draws each epoch's prompts in the order an uninterrupted run does."""

import pytest
from trl.trainer.utils import RepeatSampler

from opefo_trl.trainer.sampler import EpochSeededSampler


def _epochs(sampler, epochs):
    orders = []
    for epoch in epochs:
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
    return orders


@pytest.mark.parametrize("repeat_count", [1, 3])
def test_every_epoch_draws_the_order_of_an_uninterrupted_run(repeat_count):
    def make():
        return RepeatSampler(range(10), mini_repeat_count=2, batch_size=5, repeat_count=repeat_count, seed=7)

    # TRL's own sampler iterated epoch after epoch is the reference: an uninterrupted run.
    reference = make()
    uninterrupted = [list(reference) for _ in range(4)]
    assert uninterrupted[0] != uninterrupted[1]
    assert _epochs(EpochSeededSampler(make()), range(4)) == uninterrupted
    # A run resumed at the start of epoch 2 (a fresh sampler, as after a restart), and again in epoch 3.
    assert _epochs(EpochSeededSampler(make()), [2, 3]) == uninterrupted[2:]
    assert _epochs(EpochSeededSampler(make()), [3]) == uninterrupted[3:]
    # TRL's sampler alone replays epoch 0 after a restart: what this fixes.
    assert list(make()) == uninterrupted[0]
    unshuffled = EpochSeededSampler(RepeatSampler(range(4), mini_repeat_count=1, shuffle=False))
    assert _epochs(unshuffled, [0, 5]) == [[0, 1, 2, 3]] * 2 and len(unshuffled) == 4
