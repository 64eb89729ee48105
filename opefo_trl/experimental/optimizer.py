"""The optimizer's update as a function of the gradient, as torch computes it (docs/algorithm.md s. 4).

Pure torch, no TRL import. ``optimizer_update`` is the change ``optimizer.step()`` makes with a given gradient, read
from the optimizer's state before the step (moments, bias correction, eps, amsgrad, weight decay);
``adam_preconditioner`` is Adam's diagonal D of that step and ``PreconditionedDirection`` the direction D grad Hbar
of the `param` estimate; ``check_optimizer`` refuses an optimizer these do not reproduce. ``inner`` and
``global_norm`` take products and norms of parameter lists in fp64, and ``clip_coefficient`` is the Trainer's gradient
clipping.

Example:
    >>> import torch
    >>> p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    >>> optimizer = torch.optim.AdamW([p], lr=0.1, weight_decay=0.0)
    >>> update = optimizer_update(optimizer, optimizer.param_groups[0], p, torch.tensor([0.5, -0.5]))
    >>> p.grad = torch.tensor([0.5, -0.5]); before = p.detach().clone(); optimizer.step()
    >>> bool(torch.allclose(p.detach() - before, update))
    True
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

#: Elements per chunk of an fp64 inner product or update (bounds its temporary memory).
FP64_CHUNK = 1 << 22


def inner(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """sum_i <a_i, b_i> over two lists of tensors, accumulated in fp64 (the products of fp32 values are exact there).

    >>> inner([torch.tensor([1.0, 2.0])], [torch.tensor([3.0, 4.0])])
    11.0
    """
    total = 0.0
    for x, y in zip(a, b, strict=True):
        for xs, ys in zip(
            x.detach().reshape(-1).split(FP64_CHUNK), y.detach().reshape(-1).split(FP64_CHUNK), strict=True
        ):
            total += float(torch.dot(xs.double(), ys.double()))
    return total


def global_norm(tensors: Sequence[torch.Tensor]) -> float:
    """Euclidean norm of a list of tensors taken as one vector (fp64 accumulation)."""
    return math.sqrt(inner(tensors, tensors))


#: Optimizers whose update ``optimizer_update`` reproduces, per preconditioner.
SUPPORTED_OPTIMIZERS = {"adam": (torch.optim.Adam,), "none": (torch.optim.SGD,)}


def check_optimizer(optimizer: torch.optim.Optimizer, preconditioner: str) -> None:
    """Raise ValueError, naming the fix, unless ``optimizer_update`` reproduces this optimizer's update exactly:
    torch's Adam/AdamW for ``preconditioner="adam"`` (AdamW subclasses Adam), plain SGD (no momentum) for "none"."""
    name = type(optimizer).__name__
    if not isinstance(optimizer, SUPPORTED_OPTIMIZERS[preconditioner]):
        fix = (
            "Use optim='adamw_torch' (or 'adamw_torch_fused'), or entropy_flow_preconditioner='none' with optim='sgd'"
            if preconditioner == "adam"
            else "Use entropy_flow_preconditioner='adam' (the Adam/AdamW preconditioner), or optim='sgd' without "
            "momentum"
        )
        expected = "Adam/AdamW" if preconditioner == "adam" else "plain SGD"
        raise ValueError(
            f"entropy_flow_preconditioner={preconditioner!r} models the update of {expected}, but the optimizer is "
            f"{name}: the flow would describe a step that never happens. {fix}."
        )
    for group in optimizer.param_groups:
        if group.get("maximize"):
            raise ValueError(f"The `param` estimate models a minimising optimizer; {name} has maximize=True.")
        if preconditioner == "none" and (group.get("momentum", 0) or group.get("weight_decay", 0)):
            raise ValueError(
                "entropy_flow_preconditioner='none' models plain SGD (theta -= lr * g), but the optimizer has "
                f"momentum={group.get('momentum', 0)}, weight_decay={group.get('weight_decay', 0)}. Set both to 0, or "
                "use AdamW with entropy_flow_preconditioner='adam'."
            )


def param_groups(optimizer: torch.optim.Optimizer) -> dict[int, dict]:
    return {id(p): group for group in optimizer.param_groups for p in group["params"]}


def compute_dtype(p: torch.Tensor) -> torch.dtype:
    return torch.promote_types(p.dtype, torch.float32)


@torch.no_grad()
def optimizer_update(
    optimizer: torch.optim.Optimizer | None,
    group: dict | None,
    p: torch.Tensor,
    grad: torch.Tensor,
    dtype: torch.dtype | None = None,
    elements: slice | None = None,
):
    """The change of ``p`` that ``optimizer.step()`` makes with gradient ``grad``, from the optimizer's state before
    the step (the state is read, not changed); ``group`` is p's parameter group. None: SGD with learning rate 1.

    SGD: -lr g. Adam/AdamW exactly as torch computes it: m = beta1 m_prev + (1 - beta1) g,
    v = beta2 v_prev + (1 - beta2) g^2 (amsgrad: the running maximum), update = -lr m / (1 - beta1^t) /
    (sqrt(v / (1 - beta2^t)) + eps), plus AdamW's decoupled weight decay -lr weight_decay p (Adam's coupled one adds
    weight_decay p to g). In ``dtype``, by default torch's (float32; float64 for float64 parameters). ``elements``:
    only these elements of the flattened parameter (``grad`` holds just them; the result is flat)."""
    dtype = dtype or compute_dtype(p)
    g = grad.to(dtype)

    def part(t: torch.Tensor) -> torch.Tensor:
        return t.detach() if elements is None else t.detach().reshape(-1)[elements]

    if optimizer is None:
        return -g
    assert group is not None, "an optimizer's update needs p's parameter group"
    lr = float(group["lr"])
    if "betas" not in group:
        return g.mul(-lr)
    state = optimizer.state.get(p) or {}
    (beta1, beta2), eps, decay = group["betas"], group["eps"], group["weight_decay"]
    decoupled = group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))
    if decay and not decoupled:
        g = g + decay * part(p).to(dtype)
    step = float(state["step"]) + 1 if state else 1.0
    bias1, bias2 = 1 - beta1**step, 1 - beta2**step
    m = g * ((1 - beta1) / bias1)
    v = g.square().mul_((1 - beta2) / bias2)
    if state:
        m.add_(part(state["exp_avg"]).to(dtype), alpha=beta1 / bias1)
        v.add_(part(state["exp_avg_sq"]).to(dtype), alpha=beta2 / bias2)
        if group.get("amsgrad"):
            torch.maximum(v, part(state["max_exp_avg_sq"]).to(dtype) / bias2, out=v)
    update = m.div_(v.sqrt_().add_(eps)).mul_(-lr)
    if decay and decoupled:
        update.sub_(part(p).to(dtype), alpha=lr * decay)
    return update


@torch.no_grad()
def adam_preconditioner(optimizer: torch.optim.Optimizer | None, group: dict | None, p, grad) -> torch.Tensor | None:
    """D = 1 / (sqrt(v_hat) + eps) of the next Adam step with gradient ``grad`` (None for plain SGD: D = 1)."""
    if optimizer is None:
        return None
    assert group is not None, "an optimizer's preconditioner needs p's parameter group"
    if "betas" not in group:
        return None
    state = optimizer.state.get(p) or {}
    beta2, eps = group["betas"][1], group["eps"]
    step = float(state["step"]) + 1 if state else 1.0
    v = grad.to(compute_dtype(p)).square().mul_(1 - beta2)
    if state:
        v.add_(state["exp_avg_sq"].to(v.dtype), alpha=beta2)
        if group.get("amsgrad"):
            torch.maximum(v, state["max_exp_avg_sq"].to(v.dtype), out=v)
    return v.div_(1 - beta2**step).sqrt_().add_(eps).reciprocal_()


def clip_coefficient(norm: float, max_grad_norm: float | None) -> float:
    """The factor the Trainer's gradient clipping (torch's clip_grad_norm_) multiplies a gradient of this norm by."""
    if not max_grad_norm or max_grad_norm <= 0:
        return 1.0
    return min(1.0, max_grad_norm / (norm + 1e-6))


class PreconditionedDirection(Sequence):
    """v_i = D_i grad_i Hbar, computed on access (no stored copy), D from the clipped loss gradient."""

    def __init__(self, optimizer, params, entropy_grad, loss_grad, clip: float):
        self.optimizer, self.params, self.entropy_grad, self.loss_grad, self.clip = (
            optimizer,
            params,
            entropy_grad,
            loss_grad,
            clip,
        )
        self.groups = param_groups(optimizer) if optimizer is not None else {}

    def __len__(self) -> int:
        return len(self.params)

    def __getitem__(self, i):
        p = self.params[i]
        d = adam_preconditioner(self.optimizer, self.groups.get(id(p)), p, self.loss_grad[i] * self.clip)
        return self.entropy_grad[i] if d is None else d.mul_(self.entropy_grad[i])
