"""The k-th largest of a token set by bisection over float32 bit patterns: the sorted value, on one rank or two."""

import sys
from pathlib import Path

import pytest
import torch

from opefo_trl.maths.order_stats import kth_largest

sys.path.insert(0, str(Path(__file__).parents[1] / "methods"))  # methods_batch: ranks as threads
from methods_batch import run_ranks  # noqa: E402


def test_kth_largest_is_the_sorted_value_for_every_k_with_ties_zeros_and_a_mask():
    gen = torch.Generator().manual_seed(0)
    values = (torch.rand(3, 40, generator=gen) * 5).round(decimals=1)  # many ties
    values[0, :5] = 0.0
    values[1, :3] = 1e-30  # subnormal-adjacent small values order above 0
    mask = torch.rand(3, 40, generator=gen) > 0.2
    values[~mask] = 1e6  # outside the mask: never counted
    ordered = values[mask].sort(descending=True).values
    for k in [1, 2, 7, len(ordered) // 2, len(ordered) - 1, len(ordered)]:
        assert kth_largest(values, mask, k).item() == ordered[k - 1].item(), k


def test_kth_largest_over_two_ranks_is_the_value_of_their_union():
    gen = torch.Generator().manual_seed(1)
    values = torch.rand(6, 30, generator=gen, dtype=torch.float64) * 3
    mask = torch.rand(6, 30, generator=gen) > 0.3
    ordered = values[mask].float().sort(descending=True).values
    for k in [1, 13, len(ordered)]:
        parts = [(values[:2], mask[:2]), (values[2:], mask[2:])]
        found = run_ranks(lambda part, context, k=k: kth_largest(*part, k, context.reduce_sum), parts)
        assert [v.item() for v in found] == [ordered[k - 1].item()] * 2


def test_kth_largest_refuses_what_it_cannot_order():
    mask = torch.ones(1, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="finite values >= 0"):
        kth_largest(torch.tensor([[1.0, -0.5, 2.0]]), mask, 1)
    with pytest.raises(ValueError, match="k=4 exceeds the 3 tokens ordered"):
        kth_largest(torch.tensor([[1.0, 0.5, 2.0]]), mask, 4)
    with pytest.raises(ValueError, match="1-based"):
        kth_largest(torch.tensor([[1.0, 0.5, 2.0]]), mask, 0)
