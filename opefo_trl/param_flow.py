"""The exact first-order flow through a network's parameters, and the exact step balance (docs/algorithm.md s. 4).

Pure torch, no TRL import. The tabular estimates of ``entropy_flow`` treat each position's logits as free
parameters; in a network all positions share the parameters theta, so one token's update moves the entropy at every
position. With Hbar the mean token entropy of the rollout batch's completion positions and an update
delta theta = eta D sum_t c_t w_t grad log pi_t (c_t = f_t A_t: the loss's coefficient of the token's log-prob; D: the
optimizer's diagonal preconditioner), to first order

    delta Hbar = eta sum_t c_t w_t u_t,    u_t = <D grad_theta Hbar, grad_theta log pi_t>.

``ParamFlowEstimator`` computes u_t for every token at once as a Jacobian-vector product of theta -> (log pi_t)_t in
the direction v = D grad Hbar, by a central finite difference

    u_t ~ (log pi_t(theta + e v) - log pi_t(theta - e v)) / (2 e),

rather than by forward-mode AD, because the log-probabilities come from TRL's fused, chunked LM-head kernel (a
custom autograd function with no forward-mode rule) and through PEFT and DDP wrappers, all of which an ordinary
forward pass handles unchanged. Two checks against exact quantities from the gradients run on every batch: the
derivative of Hbar along v (``check_error``) and the batch's net flow sum_t c_t u_t = -<v, a>, with a the loss
gradient (``lambda_error``: the error it implies for lambda* = -net / gross).

D is held fixed in that formula, but Adam's real step m_hat / (sqrt(v_hat) + eps) depends on the gradient through
both moments. ``StepModel`` therefore evaluates the first-order change of the real next step exactly, as a function
of OPEFO's lambda: the gradient of the loss with weights 1 + lambda s_t is affine in lambda, g = a + lambda b, so

    delta Hbar(lambda) = <grad Hbar, delta theta_opt(clip(lambda) * (a + lambda b))>,

with delta theta_opt the optimizer's update as torch computes it (moments, bias correction, eps, amsgrad, weight
decay) and clip the Trainer's gradient clipping. ``solve_step_balance`` finds its root in lambda.

Example (a linear softmax policy, where everything can be checked by hand):
    >>> import torch
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> W = torch.randn(5, 3, dtype=torch.float64, requires_grad=True); x = torch.randn(4, 3, dtype=torch.float64)
    >>> def score(batch):
    ...     logp = torch.log_softmax(x @ W.T, -1)
    ...     return logp[:, :1], -(logp.exp() * logp).sum(-1, keepdim=True)
    >>> estimator = ParamFlowEstimator([W], score)
    >>> mask, coefficient = torch.ones(4, 1, dtype=torch.float64), torch.tensor([[1.0], [-1.0], [0.5], [0.0]])
    >>> flow = estimator.estimate([None], [mask], lambda batch, logps, entropies: coefficient)
    >>> flow.check_error < 1e-6 and flow.lambda_error < 1e-6
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

ReduceSum = Callable[[torch.Tensor], torch.Tensor]
#: score(batch) -> (log pi_t, H_t), both (B, T), differentiable in the parameters when grad is enabled.
ScoreFn = Callable[[Any], tuple[torch.Tensor, torch.Tensor]]
#: coefficients(batch, logps, entropies) -> c_t (B, T): the unweighted loss is L = -sum_t c_t log pi_t.
CoefficientFn = Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor]

#: Sizes of the finite-difference perturbation relative to the norm of the trainable parameters, tried in this order
#: until both checks pass (else the one with the smallest lambda* error is used). The error of a central difference is
#: curvature (~ e^2) plus the forward's rounding (~ eps / e). Measured on the warm tiny test model against a float64
#: reference (64 x 24 tokens, lambda* = -0.106), the float32 lambda* error was 4.4e-4 / 4.4e-5 / 3.9e-6 / 1.7e-6 /
#: 2.8e-5 / 2.4e-5 at 3e-4 / 1e-4 / 3e-5 / 1e-5 / 3e-6 / 1e-6, and the net-flow check's bound 1.3-1.8x the error.
FD_RELATIVE_STEPS = {torch.float32: (1e-5, 3e-5, 1e-4, 3e-6), torch.float64: (1e-7, 1e-6, 1e-8)}
#: The derivative of Hbar along the direction may differ from the exact one by this much (relative).
CHECK_TOLERANCE = 0.05
#: The lambda* error implied by the net-flow check may be this fraction of |lambda*|.
LAMBDA_ERROR_TOLERANCE = 0.1
#: Elements per chunk of an fp64 inner product (bounds its temporary memory).
_CHUNK = 1 << 22


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def inner(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """sum_i <a_i, b_i> over two lists of tensors, accumulated in fp64 (the products of fp32 values are exact there).

    >>> inner([torch.tensor([1.0, 2.0])], [torch.tensor([3.0, 4.0])])
    11.0
    """
    total = 0.0
    for x, y in zip(a, b, strict=True):
        for xs, ys in zip(x.detach().reshape(-1).split(_CHUNK), y.detach().reshape(-1).split(_CHUNK), strict=True):
            total += float(torch.dot(xs.double(), ys.double()))
    return total


def global_norm(tensors: Sequence[torch.Tensor]) -> float:
    """Euclidean norm of a list of tensors taken as one vector (fp64 accumulation)."""
    return math.sqrt(inner(tensors, tensors))


def relative_error(estimate: float, exact: float) -> float:
    """|estimate - exact| / |exact| (inf when exact is 0 and estimate is not)."""
    if exact == 0.0:
        return 0.0 if estimate == 0.0 else float("inf")
    return abs(estimate - exact) / abs(exact)


def finite_difference_step(
    params: Sequence[torch.Tensor], direction: Sequence[torch.Tensor], relative: float = 1e-4
) -> float:
    """e such that the perturbation e * direction has norm ``relative * max(|theta|, 1)``, |theta| the parameters'
    norm. Raises when the direction is zero (there is nothing to difference)."""
    direction_norm = global_norm(direction)
    if direction_norm == 0.0:
        raise ValueError("The finite-difference direction is zero; there is no entropy gradient to follow.")
    return relative * max(global_norm(params), 1.0) / direction_norm


@torch.no_grad()
def evaluate_on_both_sides(
    params: Sequence[torch.Tensor], direction: Sequence[torch.Tensor], step: float, evaluate: Callable[[], Any]
) -> tuple[Any, Any]:
    """``evaluate()`` at theta + step * direction and at theta - step * direction; the parameters are restored
    bit for bit afterwards (from a copy), whatever ``evaluate`` raises. ``direction`` may compute its items lazily."""
    backup = [p.detach().clone() for p in params]
    try:
        results = []
        for sign in (1.0, -1.0):
            for i, p in enumerate(params):
                p.add_(direction[i].to(p.dtype), alpha=sign * step)
            results.append(evaluate())
            for p, saved in zip(params, backup, strict=True):
                p.copy_(saved)
        return results[0], results[1]
    finally:
        for p, saved in zip(params, backup, strict=True):
            p.copy_(saved)


# ----------------------------------------------------------------------------------------------------------------------
# The optimizer's next update as a function of the gradient
# ----------------------------------------------------------------------------------------------------------------------

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


def _compute_dtype(p: torch.Tensor) -> torch.dtype:
    return torch.promote_types(p.dtype, torch.float32)


@torch.no_grad()
def optimizer_update(optimizer: torch.optim.Optimizer | None, group: dict | None, p: torch.Tensor, grad: torch.Tensor):
    """The change of ``p`` that ``optimizer.step()`` makes with gradient ``grad``, from the optimizer's state before
    the step (the state is read, not changed); ``group`` is p's parameter group. None: SGD with learning rate 1.

    SGD: -lr g. Adam/AdamW exactly as torch computes it: m = beta1 m_prev + (1 - beta1) g,
    v = beta2 v_prev + (1 - beta2) g^2 (amsgrad: the running maximum), update = -lr m / (1 - beta1^t) /
    (sqrt(v / (1 - beta2^t)) + eps), plus AdamW's decoupled weight decay -lr weight_decay p (Adam's coupled one adds
    weight_decay p to g). Float32 (float64 for float64 parameters)."""
    dtype = _compute_dtype(p)
    g = grad.to(dtype)
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
        g = g + decay * p.detach().to(dtype)
    step = float(state["step"]) + 1 if state else 1.0
    bias1, bias2 = 1 - beta1**step, 1 - beta2**step
    m = g * ((1 - beta1) / bias1)
    v = g.square().mul_((1 - beta2) / bias2)
    if state:
        m.add_(state["exp_avg"].to(dtype), alpha=beta1 / bias1)
        v.add_(state["exp_avg_sq"].to(dtype), alpha=beta2 / bias2)
        if group.get("amsgrad"):
            torch.maximum(v, state["max_exp_avg_sq"].to(dtype) / bias2, out=v)
    update = m.div_(v.sqrt_().add_(eps)).mul_(-lr)
    if decay and decoupled:
        update.sub_(p.detach().to(dtype), alpha=lr * decay)
    return update


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
    v = grad.to(_compute_dtype(p)).square().mul_(1 - beta2)
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


class StepModel:
    """The first-order change of Hbar made by the next optimizer step when the rollout's tokens are weighted
    1 + lambda s_t: the step's gradient is clip(lambda) * (a + lambda b), with a the unweighted loss gradient and b
    the gradient of the loss with coefficients s_t c_t (both summed over ranks).

    ``change(lam)`` = <grad Hbar, optimizer_update(clip(lam) (a + lam b))>, evaluated elementwise in float32
    (float64 for float64 parameters) and summed in float64. The learning rate scales every term, so the root does
    not depend on it."""

    def __init__(self, optimizer, params, entropy_grad, loss_grad, signed_grad, max_grad_norm: float | None = None):
        self.optimizer, self.params = optimizer, list(params)
        self.entropy_grad, self.a, self.b = entropy_grad, loss_grad, signed_grad
        self.max_grad_norm = max_grad_norm
        self._norms = (inner(self.a, self.a), inner(self.a, self.b), inner(self.b, self.b))
        self.evaluations = 0

    def clip(self, lam: float) -> float:
        aa, ab, bb = self._norms
        return clip_coefficient(math.sqrt(max(aa + 2 * lam * ab + lam * lam * bb, 0.0)), self.max_grad_norm)

    def change(self, lam: float) -> float:
        self.evaluations += 1
        clip = self.clip(lam)
        grads = (torch.add(a, b, alpha=lam).mul_(clip) for a, b in zip(self.a, self.b, strict=True))
        return first_order_change(self.optimizer, self.params, self.entropy_grad, grads)


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


# ----------------------------------------------------------------------------------------------------------------------
# The estimator
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class ParamFlow:
    """What ``ParamFlowEstimator.estimate`` found for one rollout batch (per micro-batch lists, (B, T) each).

    ``alignment`` is u_t; ``logps``/``entropies`` are the scoring pass's (detached, before any update);
    ``coefficients`` the c_t of the unweighted loss. ``entropy_grad`` (grad Hbar) and ``loss_grad`` (a) are summed
    over ranks and kept for the step model and the audit. The checks: ``check_error`` is the relative error of the
    finite-difference derivative of Hbar along v = D grad Hbar against the exact <grad Hbar, v>; ``lambda_error`` is
    |net_fd - net_exact| / gross, the error of lambda* = -net / gross implied by the net flow sum_t c_t u_t against
    its exact value -<v, a>. ``clip`` is that of the unweighted gradient."""

    alignment: list[torch.Tensor]
    logps: list[torch.Tensor]
    entropies: list[torch.Tensor]
    coefficients: list[torch.Tensor]
    entropy_grad: list[torch.Tensor]
    loss_grad: list[torch.Tensor] | None  # None once the trainer no longer needs it (its memory freed)
    check_error: float
    lambda_error: float
    lambda_star: float
    step_size: float
    clip: float


class ParamFlowEstimator:
    """The `param` estimate of one rollout batch: u_t = <D grad Hbar, grad log pi_t> for every token, checked.

    Args:
        params: the trainable parameters theta (perturbed in place during the finite difference, restored bit for bit).
        score: ``score(batch) -> (logps, entropies)`` of one micro-batch, (B, T), differentiable when grad is enabled;
            run in float32 or float64 (the finite difference needs it).
        reduce_sum: sums a tensor over data-parallel ranks (every rank then holds the same gradients and direction).
        optimizer: the torch Adam/AdamW whose next step D describes, or None for plain SGD (D = identity).
        max_grad_norm: the Trainer's gradient clipping, applied to the gradient D is built from.
        score_dtype: the precision ``score`` computes in, which sets the finite-difference step sizes; by default the
            parameters'. TRL's fused LM head computes log-probs and entropies in float32 even for float64 weights.

    Cost per rollout batch: a forward with two backwards per micro-batch (grad Hbar and a), two no-grad forwards
    per micro-batch per step size tried, and, for the step model, a forward with one backward (b). Extra memory:
    three copies of the trainable parameters (grad Hbar, a and, during the finite difference, the backup of theta;
    then b), in their compute dtype.
    """

    def __init__(
        self,
        params,
        score: ScoreFn,
        reduce_sum: ReduceSum = _identity,
        optimizer=None,
        max_grad_norm=None,
        score_dtype: torch.dtype | None = None,
    ):
        self.params = [p for p in params if p.requires_grad]
        self.score, self.reduce_sum = score, reduce_sum
        self.optimizer, self.max_grad_norm = optimizer, max_grad_norm
        dtype = self.params[0].dtype
        if dtype not in FD_RELATIVE_STEPS:
            raise ValueError(
                f"The `param` estimate differences float32 or float64 forwards; the parameters are {dtype}."
            )
        # The steps of the coarser of the parameters' and the forward's precision.
        precision = torch.float32 if torch.float32 in (dtype, score_dtype) else dtype
        self.relative_steps = FD_RELATIVE_STEPS[precision]

    def _zeros(self) -> list[torch.Tensor]:
        return [torch.zeros_like(p, dtype=_compute_dtype(p)) for p in self.params]

    def _reduce(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        for t in tensors:
            t.copy_(self.reduce_sum(t))
        return tensors

    def _accumulate(self, totals: list[torch.Tensor], objective: torch.Tensor, retain: bool) -> None:
        parts = torch.autograd.grad(objective, self.params, retain_graph=retain, allow_unused=True)
        for running, part in zip(totals, parts, strict=True):
            if part is not None:
                running.add_(part)

    def _sum(self, value: torch.Tensor) -> float:
        return float(self.reduce_sum(value.double().reshape(1))[0])

    def estimate(self, batches: Sequence[Any], masks: Sequence[torch.Tensor], coefficients: CoefficientFn) -> ParamFlow:
        """u_t of every micro-batch; ``masks`` select the tokens Hbar averages (the loss tokens), ``coefficients``
        gives the unweighted loss's c_t from the scoring pass's detached log pi_t and H_t."""
        tokens = max(self._sum(cast(torch.Tensor, sum(mask.sum() for mask in masks))), 1.0)  # masks: never empty
        entropy_grad, loss_grad = self._zeros(), self._zeros()
        logps_list, entropies_list, coefficient_list = [], [], []
        with torch.enable_grad():
            for batch, mask in zip(batches, masks, strict=True):
                logps, entropies = self.score(batch)
                coefficient = coefficients(batch, logps.detach(), entropies.detach()).to(logps.dtype)
                self._accumulate(entropy_grad, (entropies * mask).sum() / tokens, retain=True)
                self._accumulate(loss_grad, -(coefficient * logps).sum(), retain=False)
                logps_list.append(logps.detach())
                entropies_list.append(entropies.detach())
                coefficient_list.append(coefficient)
        self._reduce(entropy_grad)
        self._reduce(loss_grad)
        clip = clip_coefficient(global_norm(loss_grad), self.max_grad_norm) if self.optimizer is not None else 1.0
        direction = PreconditionedDirection(self.optimizer, self.params, entropy_grad, loss_grad, clip)
        exact_derivative = inner(entropy_grad, direction)  # d Hbar / d e along v
        exact_net = -inner(direction, loss_grad)  # sum_t c_t u_t = <v, -a>
        flow = ParamFlow(
            alignment=[torch.zeros_like(lp) for lp in logps_list],
            logps=logps_list,
            entropies=entropies_list,
            coefficients=coefficient_list,
            entropy_grad=entropy_grad,
            loss_grad=loss_grad,
            check_error=0.0,
            lambda_error=0.0,
            lambda_star=0.0,
            step_size=0.0,
            clip=clip,
        )
        if exact_derivative == 0.0:  # no entropy gradient: no token moves Hbar to first order
            return flow

        def evaluate():
            return [self.score(batch) for batch in batches]

        best = None
        for relative in self.relative_steps:  # the first step size whose checks pass; else the most accurate one
            step = finite_difference_step(self.params, direction, relative)
            plus, minus = evaluate_on_both_sides(self.params, direction, step, evaluate)
            alignment = [(lp - lm) / (2 * step) for (lp, _), (lm, _) in zip(plus, minus, strict=True)]
            entropy_change = sum(((hp - hm) * m).sum() for (_, hp), (_, hm), m in zip(plus, minus, masks, strict=True))
            derivative = self._sum(entropy_change) / tokens / (2 * step)
            net = self._sum(sum((c * u).sum() for c, u in zip(coefficient_list, alignment, strict=True)))
            gross = self._sum(sum((c * u).abs().sum() for c, u in zip(coefficient_list, alignment, strict=True)))
            check = relative_error(derivative, exact_derivative)
            lam = -net / gross if gross > 0 else 0.0
            lam_error = abs(net - exact_net) / gross if gross > 0 else 0.0
            passed = check <= CHECK_TOLERANCE and lam_error <= LAMBDA_ERROR_TOLERANCE * abs(lam)
            if best is None or lam_error < best[0] or passed:
                best = (lam_error, check, lam, step, alignment)
            if passed:
                break
        assert best is not None  # relative_steps is never empty
        flow.lambda_error, flow.check_error, flow.lambda_star, flow.step_size, alignment = best
        flow.alignment = [u.float() for u in alignment]
        return flow

    def signed_gradient(self, batches: Sequence[Any], signed_coefficients: Sequence[torch.Tensor]):
        """b = grad of -sum_t s_t c_t log pi_t (summed over ranks): the gradient's derivative in lambda when the
        tokens are weighted 1 + lambda s_t. One forward and backward per micro-batch."""
        total = self._zeros()
        with torch.enable_grad():
            for batch, coefficient in zip(batches, signed_coefficients, strict=True):
                logps, _ = self.score(batch)
                self._accumulate(total, -(coefficient.to(logps.dtype) * logps).sum(), retain=False)
        return self._reduce(total)

    def step_model(self, flow: ParamFlow, signed_grad) -> StepModel:
        return StepModel(
            self.optimizer, self.params, flow.entropy_grad, flow.loss_grad, signed_grad, self.max_grad_norm
        )


def warn_imprecise(flow: ParamFlow, steps: Sequence[float]) -> str | None:
    """The warning for a batch whose checks failed at every step size (None when they passed)."""
    if flow.check_error <= CHECK_TOLERANCE and flow.lambda_error <= LAMBDA_ERROR_TOLERANCE * abs(flow.lambda_star):
        return None
    return (
        f"entropy_flow_estimate='param': at every finite-difference step size tried {tuple(steps)}, the checks "
        f"against exact values fail on this batch: the derivative of the mean entropy is off by "
        f"{flow.check_error:.2%}, and the net flow implies a lambda* error of {flow.lambda_error:.3g} (lambda* = "
        f"{flow.lambda_star:.3g}; tolerance {LAMBDA_ERROR_TOLERANCE:.0%} of it). The per-token flow is imprecise "
        "(float32 resolution or strong curvature): entropy_flow/param_lambda_error logs the bound every step."
    )
