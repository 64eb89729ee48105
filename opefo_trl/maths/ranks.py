"""Sums over data-parallel ranks: what every statistic taken "over the batch" is reduced with.

Pure torch, no TRL import. A ``ReduceSum`` returns the element-wise sum of a tensor over every rank (every rank makes
the same calls in the same order); the trainer gives accelerate's ``reduce(tensor, reduction="sum")``. On a single
process the sum over ranks is the tensor itself (``single_process_sum``, the default wherever one is taken).

Example:
    >>> import torch
    >>> single_process_sum(torch.tensor([1.0, 2.0]))
    tensor([1., 2.])
"""

from __future__ import annotations

from collections.abc import Callable

import torch

ReduceSum = Callable[[torch.Tensor], torch.Tensor]


def single_process_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum over ranks of a single process: ``x`` itself."""
    return x
