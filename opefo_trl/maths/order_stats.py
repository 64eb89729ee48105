"""Order statistics of a token set spread over data-parallel ranks, computed with sums only (docs/algorithm.md
section 11).

Pure torch, no TRL import. ``kth_largest`` finds the k-th largest of the non-negative values of every rank's masked
tokens exactly: a non-negative float32's bit pattern, read as an int32, orders like the value, so a bisection over the
31 bits, each step a count of the tokens at or above the midpoint summed over ranks (``reduce_sum``), lands on the bit
pattern of the k-th largest value. Every rank makes the same 31 calls in the same order.

Example:
    >>> import torch
    >>> values = torch.tensor([[0.5, 3.0, 1.0, 2.0]])
    >>> float(kth_largest(values, torch.ones(1, 4, dtype=torch.bool), 2))
    2.0
"""

from __future__ import annotations

import torch

from opefo_trl.maths.ranks import ReduceSum, single_process_sum

#: The bit pattern of float32 +inf: every finite non-negative float32 lies below it.
_FLOAT32_INF_BITS = 0x7F800000


@torch.no_grad()
def kth_largest(
    values: torch.Tensor,
    mask: torch.Tensor,
    k: int,
    reduce_sum: ReduceSum = single_process_sum,
) -> torch.Tensor:
    """The k-th largest (1-based) of ``values[mask]`` over every rank, as a float32 scalar; ``values`` must be finite
    and >= 0 on the masked tokens, and ``k`` at most their count over ranks (1: the maximum; the count: the minimum).
    """
    selected = values.detach().float()[mask]
    if selected.numel() and not (torch.isfinite(selected).all() and (selected >= 0).all()):
        raise ValueError("kth_largest orders finite values >= 0 only.")
    if k < 1:
        raise ValueError(f"k is 1-based; got {k}.")
    bits = selected.view(torch.int32)
    low, high = 0, _FLOAT32_INF_BITS  # count(bits >= low) >= k; count(bits >= high) < k
    total = int(reduce_sum(torch.tensor(float(bits.numel()), dtype=torch.float64, device=values.device)))
    if k > total:
        raise ValueError(f"k={k} exceeds the {total} tokens ordered.")
    while high - low > 1:
        middle = (low + high) // 2
        count = reduce_sum((bits >= middle).sum().to(torch.float64))
        if int(count) >= k:
            low = middle
        else:
            high = middle
    return torch.tensor(low, dtype=torch.int32).view(torch.float32).to(values.device)
