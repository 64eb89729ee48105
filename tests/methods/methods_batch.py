"""A random TokenBatch for the method tests."""

import torch

from opefo_trl.maths.entropy_flow import entropy_flow
from opefo_trl.methods import TokenBatch


def random_batch(seed=0, b=4, t=50, old_shift=None):
    gen = torch.Generator().manual_seed(seed)
    logps = -torch.rand(b, t, generator=gen) * 6
    adv = torch.randn(b, generator=gen)[:, None].expand(b, t) * 3
    factor = torch.ones(b, t)
    factor[0, -7:] = 0  # padding
    old = None if old_shift is None else logps - old_shift(gen, b, t)
    entropies = torch.rand(b, t, generator=gen) * 2
    flow = entropy_flow(logps, entropies, adv)
    return TokenBatch(logps=logps, entropies=entropies, advantages=adv, factor=factor, flow=flow, old_logps=old)


def run_ranks(work, inputs, timeout=60.0):
    """``work(input, context)`` on each input in its own thread, as data-parallel ranks: ``context.reduce_sum`` waits
    for every rank's tensor and returns their sum, so every rank must make the same calls in the same order (a rank
    that calls it a different number of times leaves the others waiting: BrokenBarrierError)."""
    import threading

    from opefo_trl.methods import MethodContext

    barrier = threading.Barrier(len(inputs), timeout=timeout)
    slots = [None] * len(inputs)
    results = [None] * len(inputs)
    errors = []

    def rank(index, item):
        def reduce_sum(tensor):
            slots[index] = tensor.clone()
            barrier.wait()
            total = sum(slots[1:], slots[0].clone())
            barrier.wait()  # every rank has read the slots before any writes the next call's
            return total

        try:
            results[index] = work(item, MethodContext(reduce_sum=reduce_sum))
        except Exception as error:  # re-raised in the test's thread
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(i, item)) for i, item in enumerate(inputs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def split_rows(batch, rows):
    """The TokenBatch's rows [:rows] and [rows:], as two ranks' batches."""
    import dataclasses

    def part(index):
        return TokenBatch(
            **{
                f.name: None if getattr(batch, f.name) is None else getattr(batch, f.name)[index]
                for f in dataclasses.fields(TokenBatch)
            }
        )

    return part(slice(None, rows)), part(slice(rows, None))
