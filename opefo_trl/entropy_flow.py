"""Entropy flow of a policy-gradient step and the OPEFO balance (SPEC.md sections 1 and 2).

Pure torch, no TRL import: every function here can be checked against SPEC.md line by line.

Notation (per completion token t): ``logp`` = log pi_t of the sampled token under the current policy at the
training temperature, ``entropy`` = H_t, ``advantage`` = A_t, ``mask`` = m_t.

A policy-gradient step on token t moves the entropy at that position by, to first order (eta dropped, it
cancels in lambda*),

    full:      d_t = -A_t [pi_t (log pi_t + H_t) - S2_t],  S2_t = sum_k pi_k^2 log pi_k + H_t sum_k pi_k^2
    opefo:     d_t = -A_t (1 - pi_t)^2 (log pi_t + H_t)          (default; the paper's diagnostic)
    onaction:  d_t = -A_t pi_t (1 - pi_t) (log pi_t + H_t)
    sign:      d_t = -A_t (log pi_t + H_t)

OPEFO splits the batch into S+ = {d_t > 0} and S- = {d_t < 0}, with P = sum_{S+} d_t and N = sum_{S-} |d_t|,
and rescales the two sets by 1 +/- lambda*, lambda* = (N - P) / (N + P), so that (1 + lambda*) P = (1 - lambda*) N:
the reweighted first-order entropy flow of the batch is zero.

Example:
    >>> import torch
    >>> logp = torch.log(torch.tensor([[0.9, 0.2]])); H = torch.tensor([[0.4, 1.5]])
    >>> flow = entropy_flow(logp, H, torch.tensor([1.0]))
    >>> stats = flow_stats(flow, torch.ones(1, 2))
    >>> lam = lambda_star(stats.increase, stats.decrease)
    >>> w = token_weights(flow, lam)
    >>> bool(abs((w * flow).sum()) < 1e-6)
    True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FLOW_ESTIMATES = ("opefo", "onaction", "sign", "full")
SIDES = ("both", "increase_only", "decrease_only")


def _per_token(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Broadcast sequence-level advantages (B,) or (B, 1) to per-token (B, T)."""
    advantages = advantages.to(torch.float32)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    if like.dim() != 2 or advantages.dim() != 2 or advantages.shape[0] != like.shape[0]:
        raise ValueError(
            f"Expected per-token tensors of shape (B, T) and advantages of shape (B,), (B, 1) or (B, T); got "
            f"{tuple(like.shape)} and {tuple(advantages.shape)}."
        )
    return advantages.expand_as(like)


@torch.no_grad()
def entropy_flow(
    logps: torch.Tensor,
    entropies: torch.Tensor,
    advantages: torch.Tensor,
    estimate: str = "opefo",
    sum_sq_probs: torch.Tensor | None = None,
    sum_sq_probs_log_probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token first-order entropy change d_t of a policy-gradient step (fp32, detached).

    Args:
        logps: (B, T) log-probability of the sampled tokens.
        entropies: (B, T) entropy of the policy at each position.
        advantages: (B,) sequence-level or (B, T) token-level advantages.
        estimate: one of ``FLOW_ESTIMATES``.
        sum_sq_probs, sum_sq_probs_log_probs: (B, T) sum_k pi_k^2 and sum_k pi_k^2 log pi_k; only for ``full``.
    """
    if estimate not in FLOW_ESTIMATES:
        raise ValueError(f"Unknown entropy-flow estimate {estimate!r}; choose one of {FLOW_ESTIMATES}.")
    logps = logps.detach().float()
    entropies = entropies.detach().float()
    adv = _per_token(advantages.detach(), logps)
    surprise_gap = logps + entropies  # log pi_t + H_t: > 0 for tokens more likely than "typical"
    if estimate == "sign":
        return -adv * surprise_gap
    probs = logps.exp()
    if estimate == "opefo":
        return -adv * (1.0 - probs).square() * surprise_gap
    if estimate == "onaction":
        return -adv * probs * (1.0 - probs) * surprise_gap
    if sum_sq_probs is None or sum_sq_probs_log_probs is None:
        raise ValueError("The `full` entropy-flow estimate needs sum_sq_probs and sum_sq_probs_log_probs.")
    s2 = sum_sq_probs_log_probs.detach().float() + entropies * sum_sq_probs.detach().float()
    return -adv * (probs * surprise_gap - s2)


@dataclass
class FlowStats:
    """Sums over a batch (and, once reduced, over all ranks) that define lambda*.

    increase = P (sum of d_t over S+), decrease = N (sum of |d_t| over S-), and the token counts of S+, S- and
    of all valid tokens. Everything is a sum so that ranks and micro-batches combine by addition.
    """

    increase: torch.Tensor
    decrease: torch.Tensor
    increase_tokens: torch.Tensor
    decrease_tokens: torch.Tensor
    tokens: torch.Tensor

    def to_tensor(self) -> torch.Tensor:
        """Pack into one fp64 vector (for a single all-reduce)."""
        return torch.stack(
            [self.increase, self.decrease, self.increase_tokens, self.decrease_tokens, self.tokens]
        ).double()

    @classmethod
    def from_tensor(cls, packed: torch.Tensor) -> FlowStats:
        return cls(*packed.unbind(0))

    def __add__(self, other: FlowStats) -> FlowStats:
        return FlowStats.from_tensor(self.to_tensor() + other.to_tensor().to(self.increase.device))

    @property
    def net(self) -> torch.Tensor:
        """Net first-order entropy flow P - N of the unweighted update."""
        return self.increase - self.decrease

    @property
    def lambda_star(self) -> torch.Tensor:
        return lambda_star(self.increase, self.decrease)

    def metrics(self, prefix: str = "entropy_flow/") -> dict[str, float]:
        """The scalars TRL logs: lambda*, P, N, net flow and the token fractions of S+ and S-."""
        tokens = self.tokens.clamp(min=1)
        return {
            f"{prefix}lambda": float(self.lambda_star),
            f"{prefix}increase": float(self.increase),
            f"{prefix}decrease": float(self.decrease),
            f"{prefix}net": float(self.net),
            f"{prefix}increase_token_frac": float(self.increase_tokens / tokens),
            f"{prefix}decrease_token_frac": float(self.decrease_tokens / tokens),
        }


@torch.no_grad()
def flow_stats(flow: torch.Tensor, mask: torch.Tensor) -> FlowStats:
    """P, N and the set sizes of the valid (mask > 0) tokens of ``flow``, as fp64 sums."""
    flow = flow.double()
    valid = mask.bool()
    increasing = valid & (flow > 0)
    decreasing = valid & (flow < 0)
    return FlowStats(
        increase=flow.where(increasing, 0.0).sum(),
        decrease=(-flow).where(decreasing, 0.0).sum(),
        increase_tokens=increasing.sum().double(),
        decrease_tokens=decreasing.sum().double(),
        tokens=valid.sum().double(),
    )


def lambda_star(increase: torch.Tensor, decrease: torch.Tensor) -> torch.Tensor:
    """lambda* = (N - P) / (N + P), and 0 when N + P = 0 (nothing flows)."""
    total = increase + decrease
    return torch.where(total > 0, (decrease - increase) / total.clamp(min=torch.finfo(total.dtype).tiny), 0.0)


@torch.no_grad()
def token_weights(flow: torch.Tensor, lam: torch.Tensor | float, sides: str = "both") -> torch.Tensor:
    """Detached fp32 weights: 1 + lambda on S+, 1 - lambda on S-, 1 where d_t = 0.

    ``sides="increase_only"`` rescales only S+ (S- keeps weight 1), ``"decrease_only"`` only S-.
    ``lam`` in [-1, 1] keeps every weight non-negative, which is what makes multiplying the advantage by the
    weight exactly equivalent to weighting the per-token loss for every TRL loss type, clipping included.
    """
    if sides not in SIDES:
        raise ValueError(f"Unknown sides {sides!r}; choose one of {SIDES}.")
    lam = torch.as_tensor(lam, dtype=torch.float32, device=flow.device)
    ones = torch.ones_like(flow, dtype=torch.float32)
    up = ones + lam if sides in ("both", "increase_only") else ones
    down = ones - lam if sides in ("both", "decrease_only") else ones
    return torch.where(flow > 0, up, torch.where(flow < 0, down, ones))
