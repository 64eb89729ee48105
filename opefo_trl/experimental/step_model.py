"""The first-order entropy change of the real next optimizer step, and the exact step balance (docs/algorithm.md s. 4).

Pure torch, no TRL import. The `param` estimate holds Adam's preconditioner D fixed, but Adam's real step
m_hat / (sqrt(v_hat) + eps) depends on the gradient through both moments. ``StepModel`` therefore evaluates the
first-order change of the mean token entropy Hbar made by the real next step exactly, as a function of OPEFO's
lambda: the gradient of the loss with token weights 1 + lambda s_t is affine in lambda, g = a + lambda b, so

    delta Hbar(lambda) = <grad Hbar, delta theta_opt(clip(lambda) * (a + lambda b))>,

with delta theta_opt the optimizer's update as torch computes it (``opefo_trl.experimental.optimizer.optimizer_update``)
and clip the Trainer's gradient clipping. ``solve_step_balance`` finds its root in lambda; ``first_order_change`` is the
same first-order change for a given gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from opefo_trl.experimental.optimizer import FP64_CHUNK, clip_coefficient, inner, optimizer_update, param_groups


@torch.no_grad()
def first_order_change(optimizer, params: Sequence[torch.Tensor], entropy_grad, grads: Iterable) -> float:
    """<grad Hbar, the update optimizer.step() makes with ``grads``> (fp64 sum): the first-order change of Hbar.
    ``grads`` may be lazy (a generator); a parameter whose gradient is None is not stepped (as in torch)."""
    groups = param_groups(optimizer) if optimizer is not None else {}
    total = 0.0
    for p, h, g in zip(params, entropy_grad, grads, strict=True):
        if g is not None:
            total += inner([h], [optimizer_update(optimizer, groups.get(id(p)), p, g)])
    return total


class StepModel:
    """The first-order change of Hbar made by the next optimizer step when the rollout's tokens are weighted
    1 + lambda s_t: the step's gradient is clip(lambda) * (a + lambda b), with a the unweighted loss gradient and b
    the gradient of the loss with coefficients s_t c_t (both summed over ranks).

    ``change(lam)`` = <grad Hbar, optimizer_update(clip(lam) (a + lam b))>, evaluated in float64 chunk by chunk:
    in float32, a + lam b rounds where it cancels, and at Adam's first step (update ~ g / (|g| + eps)) that rounding,
    divided by eps, makes change() jump by ~1e-5 of its value between neighbouring lambdas: no root to find. The
    learning rate scales every term, so the root does not depend on it."""

    def __init__(self, optimizer, params, entropy_grad, loss_grad, signed_grad, max_grad_norm: float | None = None):
        self.optimizer, self.params = optimizer, list(params)
        self.entropy_grad, self.a, self.b = entropy_grad, loss_grad, signed_grad
        self.max_grad_norm = max_grad_norm
        self._norms = (inner(self.a, self.a), inner(self.a, self.b), inner(self.b, self.b))
        self._groups = param_groups(optimizer) if optimizer is not None else {}
        self.evaluations = 0

    def clip(self, lam: float) -> float:
        aa, ab, bb = self._norms
        return clip_coefficient(math.sqrt(max(aa + 2 * lam * ab + lam * lam * bb, 0.0)), self.max_grad_norm)

    @torch.no_grad()
    def change(self, lam: float) -> float:
        self.evaluations += 1
        clip, groups, dots = self.clip(lam), self._groups, []
        for p, h, a, b in zip(self.params, self.entropy_grad, self.a, self.b, strict=True):
            h, a, b = (t.detach().reshape(-1) for t in (h, a, b))
            for start in range(0, p.numel(), FP64_CHUNK):
                part = slice(start, start + FP64_CHUNK)
                g = torch.add(a[part].double(), b[part].double(), alpha=lam).mul_(clip)
                update = optimizer_update(self.optimizer, groups.get(id(p)), p, g, torch.float64, part)
                dots.append(torch.dot(h[part].double(), update))
        # summed on the device: one host sync per evaluation, not one per chunk
        return float(torch.stack([d.to(dots[0].device) for d in dots]).sum()) if dots else 0.0


@dataclass
class StepBalance:
    """The result of ``solve_step_balance``: the lambda found, the change it leaves, that of lambda = 0 (unweighted:
    GRPO's step on the same batch and optimizer state), whether [lo, hi] brackets a root, and the evaluations."""

    lam: float
    residual: float
    unweighted: float
    bracketed: bool
    evaluations: int


def solve_step_balance(
    change: Callable[[float], float], lo: float = -1.0, hi: float = 1.0, rtol: float = 1e-7, max_evaluations: int = 60
) -> StepBalance:
    """The lambda in [lo, hi] with change(lambda) = 0, by the Illinois (modified regula falsi) method on a bracket
    that contains 0: converges superlinearly where change is smooth and never leaves the bracket. Stops when
    |change| <= rtol * |change(0)|, the bracket is narrower than 1e-12 or after ``max_evaluations``; returns the best
    point seen. Without a sign change on [lo, hi] that is the end point with the smaller |change|
    (``bracketed=False``). Reweighting S+ up raises the flow, so the root lies above 0 when change(0) < 0: that end
    is tried first.

    >>> result = solve_step_balance(lambda lam: -0.5 + 2.0 * lam + lam**3)
    >>> round(result.lam, 9), result.bracketed
    (0.242839733, True)
    """
    seen: dict[float, float] = {}

    def f(x: float) -> float:
        seen[x] = change(x)
        return seen[x]

    def result(bracketed: bool) -> StepBalance:
        x = min(seen, key=lambda key: abs(seen[key]))
        return StepBalance(x, seen[x], seen[0.0], bracketed, len(seen))

    f0 = f(0.0)
    if f0 == 0.0:
        return result(True)
    xa, fa, xb, fb = 0.0, f0, None, None
    for end in (hi, lo) if f0 < 0 else (lo, hi):
        if (f(end) > 0) != (f0 > 0) or seen[end] == 0.0:
            xb, fb = end, seen[end]
            break
    if xb is None or fb is None:  # (set together)
        return result(False)
    tolerance, side = rtol * abs(f0), 0
    while fb != 0.0 and len(seen) < max_evaluations and abs(xb - xa) > 1e-12:
        x = (xa * fb - xb * fa) / (fb - fa)
        fx = f(x)
        if abs(fx) <= tolerance:
            break
        if (fx > 0) == (fb > 0):  # x replaces b; a retained twice in a row gets its value halved (Illinois)
            xb, fb = x, fx
            fa = fa / 2 if side == -1 else fa
            side = -1
        else:
            xa, fa = x, fx
            fb = fb / 2 if side == 1 else fb
            side = 1
    return result(True)
