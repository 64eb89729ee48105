"""opefo_trl.trainer.sampler: a resumed run draws each epoch's prompts in the order an uninterrupted run does."""

import pytest
import torch
from accelerate.data_loader import prepare_data_loader, skip_first_batches
from trl.trainer.utils import RepeatSampler

from opefo_trl.trainer.sampler import restart_at_epoch, train_sampler


def _epochs(sampler, epochs):
    orders = []
    for epoch in epochs:
        restart_at_epoch(sampler, epoch)
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
    assert _epochs(make(), range(4)) == uninterrupted
    # A run resumed at the start of epoch 2 (a fresh sampler, as after a restart), and again in epoch 3.
    assert _epochs(make(), [2, 3]) == uninterrupted[2:]
    assert _epochs(make(), [3]) == uninterrupted[3:]
    # TRL's sampler alone replays epoch 0 after a restart: what this fixes.
    assert list(make()) == uninterrupted[0]
    unshuffled = RepeatSampler(range(4), mini_repeat_count=1, shuffle=False)
    assert _epochs(unshuffled, [0, 5]) == [[0, 1, 2, 3]] * 2


@pytest.mark.parametrize("num_processes", [1, 2])
def test_the_sampler_is_found_under_accelerates_loaders(num_processes):
    """One process: accelerate keeps the batch sampler; several: it wraps it in `BatchSamplerShard`; a resume wraps
    either in `SkipBatchSampler`. The sampler found is TRL's, and restarting it changes what the loader yields."""
    sampler = RepeatSampler(range(8), mini_repeat_count=2, batch_size=4, seed=3)
    loader = torch.utils.data.DataLoader(range(8), batch_size=4, sampler=sampler)
    prepared = prepare_data_loader(loader, num_processes=num_processes, process_index=0, put_on_device=False)
    resumed = skip_first_batches(prepared, 1)
    assert train_sampler(prepared) is sampler and train_sampler(resumed) is sampler
    first = [batch.tolist() for batch in prepared]
    restart_at_epoch(sampler, 0)
    assert [batch.tolist() for batch in prepared] == first  # epoch 0 again, which TRL's sampler alone would not draw
    assert train_sampler(object()) is None
