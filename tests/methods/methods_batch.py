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
