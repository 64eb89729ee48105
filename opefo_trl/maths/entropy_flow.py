"""Entropy flow of a policy-gradient step and the OPEFO balance (docs/algorithm.md sections 1-3).

Pure torch, no TRL import: every function here can be checked against docs/algorithm.md line by line.

Notation (per completion token t): ``logp`` = log pi_t of the sampled token under the current policy at the
training temperature, ``entropy`` = H_t, ``advantage`` = A_t, ``factor`` = f_t, the coefficient of
A_t grad log pi_t in the update the loss really applies (loss mask, loss normalisation, importance weights; 0 for a
token outside the loss).

A policy-gradient step on token t moves the entropy by, to first order (the step size eta is dropped: it cancels
in lambda*), d_t = A_t u_t, where u_t ("flow per unit advantage") depends on the estimate:

    opefo:          u_t = -(1 - pi_t)^2 (log pi_t + H_t)          (our reconstruction of the paper's per-token form)
    opefo_centered: u_t = -(1 - pi_t)^2 (log pi_t + H_t) - (2 S_2 - S_3)      (the same, less its on-policy mean)
    onaction:       u_t = -pi_t (1 - pi_t) (log pi_t + H_t)
    sign:           u_t = -(log pi_t + H_t)
    full:           u_t = -[pi_t (log pi_t + H_t) - S_2]         (exact first order of a tabular softmax)
    param:          u_t = <D grad_theta Hbar, grad_theta log pi_t>   (through the network's parameters; see param_flow)

with the surprise-gap moments S_k = sum_v pi_v^k (log pi_v + H_t) of the position's softmax (S_1 = 0;
``vocab_stats.VocabStats.moments``). The tabular estimates treat each position's logits as free parameters of a
softmax; ``param`` is the exact first order change of the batch's mean token entropy Hbar in the real network, under
the optimizer's preconditioner D.

For a token sampled from pi at a fixed advantage, E_a[u_a] (``on_policy_mean``) is 2 S_2 - S_3 >= 0 for ``opefo``,
S_3 - S_2 <= 0 for ``onaction`` and exactly 0 for the others. Within a GRPO group the advantages sum to 0, so with a
zero-mean estimate the net flow is noise that shrinks like 1/sqrt(tokens) against the gross flow; with ``opefo`` it
also holds sum_t A_t E[u_t], which does not shrink (docs/algorithm.md, "What lambda* measures"). The diagnostics log
that part (``FlowStats.bias_net``) beside lambda*.

OPEFO splits the batch into S+ = {d_t > 0} and S- = {d_t < 0}, with P = sum_{S+} f_t d_t and N = sum_{S-} f_t |d_t|,
and rescales the two sets by 1 +/- lambda*, lambda* = (N - P) / (N + P), so that (1 + lambda*) P = (1 - lambda*) N:
the first-order entropy flow of the update the loss applies is zero.

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

#: Estimates from the softmax of one position (need log pi_t and H_t; ``VOCABULARY_ESTIMATES`` also S_2 and S_3).
TABULAR_ESTIMATES = ("opefo", "opefo_centered", "onaction", "sign", "full")
#: The tabular estimates that need the surprise-gap moments S_2, S_3 (a chunked pass over the vocabulary).
VOCABULARY_ESTIMATES = ("opefo_centered", "full")
#: The tabular estimates whose on-policy mean E_a[u_a] is not zero, and so is worth a diagnostic of its own.
BIASED_ESTIMATES = ("opefo", "onaction")
#: Every estimate; `param` needs the network (opefo_trl.experimental.param_flow computes its u_t).
FLOW_ESTIMATES = (*TABULAR_ESTIMATES, "param")
SIDES = ("both", "increase_only", "decrease_only")
#: What OPEFO's lambda balances: this batch's first-order flow (the paper's) or the real next optimizer step's
#: first-order entropy change (``opefo_trl.experimental.step_model.StepModel``).
BALANCES = ("batch", "step")


def check_choice(name: str, value, choices) -> None:
    """Raise a ValueError naming the option and its valid values when ``value`` is not one of ``choices``.

    >>> check_choice("opefo_sides", "left", SIDES)
    Traceback (most recent call last):
    ...
    ValueError: Unknown opefo_sides 'left'; choose one of ('both', 'increase_only', 'decrease_only').
    """
    if value not in choices:
        raise ValueError(f"Unknown {name} {value!r}; choose one of {tuple(choices)}.")


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
def flow_per_unit_advantage(
    logps: torch.Tensor,
    entropies: torch.Tensor,
    estimate: str = "opefo",
    moment2: torch.Tensor | None = None,
    moment3: torch.Tensor | None = None,
    entropy_alignment: torch.Tensor | None = None,
) -> torch.Tensor:
    """u_t, the first-order entropy change of a step on token t per unit of its advantage (fp32, detached, (B, T)).

    Args:
        logps: (B, T) log-probability of the sampled tokens.
        entropies: (B, T) entropy of the policy at each position.
        estimate: one of ``FLOW_ESTIMATES``.
        moment2, moment3: (B, T) surprise-gap moments S_2, S_3 (``VocabStats.moments``); only for
            ``VOCABULARY_ESTIMATES`` (``full`` needs S_2 only).
        entropy_alignment: (B, T) <D grad Hbar, grad log pi_t>; only for ``param``.
    """
    check_choice("entropy-flow estimate", estimate, FLOW_ESTIMATES)
    logps = logps.detach().float()
    if estimate == "param":
        if entropy_alignment is None:
            raise ValueError(
                "The `param` entropy-flow estimate needs entropy_alignment (see opefo_trl.experimental.param_flow)."
            )
        return entropy_alignment.detach().float().expand_as(logps)
    entropies = entropies.detach().float()
    surprise_gap = logps + entropies  # log pi_t + H_t: > 0 for tokens more likely than "typical"
    if estimate == "sign":
        return -surprise_gap
    probs = logps.exp()
    if estimate == "onaction":
        return -probs * (1.0 - probs) * surprise_gap
    if estimate == "opefo":
        return -(1.0 - probs).square() * surprise_gap
    if estimate == "full":
        if moment2 is None:
            raise ValueError("The `full` entropy-flow estimate needs the surprise-gap moment moment2.")
        return -(probs * surprise_gap - moment2.detach().float())
    if moment2 is None or moment3 is None:
        raise ValueError(f"The `{estimate}` entropy-flow estimate needs the surprise-gap moments moment2 and moment3.")
    return -(1.0 - probs).square() * surprise_gap - on_policy_mean("opefo", moment2, moment3)


@torch.no_grad()
def on_policy_mean(estimate: str, moment2: torch.Tensor, moment3: torch.Tensor) -> torch.Tensor:
    """E_{a ~ pi}[u_a] at each position, the tabular estimate's mean over the token a sampled there (fp32, detached):
    2 S_2 - S_3 for ``opefo``, S_3 - S_2 for ``onaction``, 0 for the others (their on-policy mean is 0 exactly).

    >>> p = torch.tensor([0.7, 0.2, 0.1]); gap = p.log() - (p * p.log()).sum()
    >>> s2, s3 = (p**2 * gap).sum(), (p**3 * gap).sum()
    >>> u = -(1 - p) ** 2 * gap  # opefo's u for each token the position could sample
    >>> bool(torch.isclose((p * u).sum(), on_policy_mean("opefo", s2, s3)))
    True
    """
    check_choice("tabular entropy-flow estimate", estimate, TABULAR_ESTIMATES)
    moment2, moment3 = moment2.detach().float(), moment3.detach().float()
    if estimate == "opefo":
        return 2.0 * moment2 - moment3
    if estimate == "onaction":
        return moment3 - moment2
    return torch.zeros_like(moment2)


@torch.no_grad()
def entropy_flow(
    logps: torch.Tensor,
    entropies: torch.Tensor,
    advantages: torch.Tensor,
    estimate: str = "opefo",
    moment2: torch.Tensor | None = None,
    moment3: torch.Tensor | None = None,
    entropy_alignment: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token first-order entropy change d_t = A_t u_t of a policy-gradient step (fp32, detached, (B, T)).

    ``advantages`` is (B,) sequence-level or (B, T) token-level; the other arguments as in
    ``flow_per_unit_advantage``.
    """
    unit = flow_per_unit_advantage(logps, entropies, estimate, moment2, moment3, entropy_alignment)
    return _per_token(advantages.detach(), unit) * unit


@dataclass
class FlowStats:
    """Sums over a batch (and, once reduced, over all ranks) that define lambda*.

    increase = P (sum of f_t d_t over S+), decrease = N (sum of f_t |d_t| over S-), and the token counts of S+, S-
    and of all tokens in the loss (f_t > 0). ``bias_net``, when computed: sum of f_t A_t E_pi[u_t], the part of the net
    flow P - N that the estimate's on-policy mean accounts for (``on_policy_mean``). Everything is a sum so that ranks
    and micro-batches combine by addition.
    """

    increase: torch.Tensor
    decrease: torch.Tensor
    increase_tokens: torch.Tensor
    decrease_tokens: torch.Tensor
    tokens: torch.Tensor
    bias_net: torch.Tensor | None = None

    def to_tensor(self) -> torch.Tensor:
        """Pack into one fp64 vector (for a single all-reduce)."""
        sums = [self.increase, self.decrease, self.increase_tokens, self.decrease_tokens, self.tokens]
        return torch.stack(sums if self.bias_net is None else [*sums, self.bias_net]).double()

    @classmethod
    def from_tensor(cls, packed: torch.Tensor) -> FlowStats:
        return cls(*packed.unbind(0))

    def __add__(self, other: FlowStats) -> FlowStats:
        if (self.bias_net is None) != (other.bias_net is None):
            raise ValueError("FlowStats: add sums that both have bias_net, or neither.")
        return FlowStats.from_tensor(self.to_tensor() + other.to_tensor().to(self.increase.device))

    @property
    def net(self) -> torch.Tensor:
        """Net first-order entropy flow P - N."""
        return self.increase - self.decrease

    @property
    def lambda_star(self) -> torch.Tensor:
        return lambda_star(self.increase, self.decrease)

    @property
    def lambda_bias(self) -> torch.Tensor | None:
        """The part of lambda* = -(P - N) / (P + N) that the estimate's on-policy mean accounts for,
        -bias_net / (P + N) (0 when nothing flows; None when bias_net was not computed).

        >>> FlowStats(*torch.tensor([1.0, 3.0, 1.0, 1.0, 2.0, -1.0])).lambda_bias
        tensor(0.2500)
        """
        if self.bias_net is None:
            return None
        total = self.increase + self.decrease
        return torch.where(total > 0, -self.bias_net / total.clamp(min=torch.finfo(total.dtype).tiny), 0.0)

    def metrics(self, prefix: str = "entropy_flow/") -> dict[str, float]:
        """The scalars TRL logs: lambda*, P, N, net flow and the token fractions of S+ and S-; with ``bias_net`` also
        the bias's part of the net flow and of lambda*, and lambda* net of it."""
        tokens = self.tokens.clamp(min=1)
        metrics = {
            f"{prefix}lambda": float(self.lambda_star),
            f"{prefix}increase": float(self.increase),
            f"{prefix}decrease": float(self.decrease),
            f"{prefix}net": float(self.net),
            f"{prefix}increase_token_frac": float(self.increase_tokens / tokens),
            f"{prefix}decrease_token_frac": float(self.decrease_tokens / tokens),
        }
        lambda_bias = self.lambda_bias
        if self.bias_net is not None and lambda_bias is not None:
            metrics[f"{prefix}bias_net"] = float(self.bias_net)
            metrics[f"{prefix}lambda_bias"] = float(lambda_bias)
            metrics[f"{prefix}lambda_net_of_bias"] = float(self.lambda_star - lambda_bias)
        return metrics

    def shares_of(self, whole: FlowStats, prefix: str) -> dict[str, float]:
        """The shares of ``whole``'s increase flow, decrease flow and tokens that these sums (of a subset of its
        tokens) hold (0 where ``whole`` has none).

        >>> part = FlowStats(*torch.tensor([1.0, 0.0, 1.0, 0.0, 2.0]))
        >>> part.shares_of(FlowStats(*torch.tensor([4.0, 3.0, 2.0, 2.0, 8.0])), "x_")
        {'x_increase_share': 0.25, 'x_decrease_share': 0.0, 'x_token_frac': 0.25}
        """

        def share(part: torch.Tensor, total: torch.Tensor) -> float:
            return float(part / total) if float(total) > 0 else 0.0

        return {
            f"{prefix}increase_share": share(self.increase, whole.increase),
            f"{prefix}decrease_share": share(self.decrease, whole.decrease),
            f"{prefix}token_frac": share(self.tokens, whole.tokens),
        }


@torch.no_grad()
def flow_stats(flow: torch.Tensor, factor: torch.Tensor, bias: torch.Tensor | None = None) -> FlowStats:
    """P, N and the set sizes of the flow ``factor * flow`` of the tokens in the loss (factor > 0), as fp64 sums.

    ``factor`` is a 0/1 loss mask or, more generally, the per-token factor of the applied update (>= 0). ``bias``:
    the per-token A_t E_pi[u_t] (``on_policy_mean``), summed like the flow into ``bias_net``; None leaves it out.
    """
    flow = flow.double()
    factor = factor.double()
    in_loss = factor > 0
    increasing = in_loss & (flow > 0)
    decreasing = in_loss & (flow < 0)
    return FlowStats(
        increase=(factor * flow).where(increasing, 0.0).sum(),
        decrease=-(factor * flow).where(decreasing, 0.0).sum(),
        increase_tokens=increasing.sum().double(),
        decrease_tokens=decreasing.sum().double(),
        tokens=in_loss.sum().double(),
        bias_net=None if bias is None else (factor * bias.double()).where(in_loss, 0.0).sum(),
    )


def lambda_star(increase: torch.Tensor, decrease: torch.Tensor) -> torch.Tensor:
    """lambda* = (N - P) / (N + P): the lambda for which (1 + lambda) P = (1 - lambda) N, and 0 when N + P = 0
    (nothing flows). It lies in [-1, 1].

    >>> lambda_star(torch.tensor(1.0), torch.tensor(3.0))
    tensor(0.5000)
    """
    total = increase + decrease
    return torch.where(total > 0, (decrease - increase) / total.clamp(min=torch.finfo(total.dtype).tiny), 0.0)


@torch.no_grad()
def weight_signs(flow: torch.Tensor, sides: str = "both") -> torch.Tensor:
    """s_t with OPEFO's weight w_t = 1 + lambda * s_t: +1 on S+, -1 on S-, 0 where d_t = 0 (fp32, (B, T)).

    ``sides="increase_only"`` rescales only S+ (s_t = 0 on S-), ``"decrease_only"`` only S-. The weights are affine in
    lambda, and so is the gradient of the reweighted loss: g = a + lambda b, b the gradient with coefficients s_t.

    >>> weight_signs(torch.tensor([[0.5, -2.0, 0.0]])).tolist()
    [[1.0, -1.0, 0.0]]
    """
    check_choice("opefo_sides", sides, SIDES)
    signs = torch.sign(flow).float()
    if sides == "increase_only":
        return signs.clamp(min=0.0)
    if sides == "decrease_only":
        return signs.clamp(max=0.0)
    return signs


@torch.no_grad()
def token_weights(flow: torch.Tensor, lam: torch.Tensor | float, sides: str = "both") -> torch.Tensor:
    """Detached fp32 weights 1 + lambda * s_t (``weight_signs``): 1 + lambda on S+, 1 - lambda on S-, 1 where
    d_t = 0 (one-sided with ``sides``).

    ``lam`` in [-1, 1] keeps every weight non-negative, which is what makes multiplying the advantage by the
    weight exactly equivalent to weighting the per-token loss for every TRL loss type, clipping included.
    """
    lam = torch.as_tensor(lam, dtype=torch.float32, device=flow.device)
    return 1.0 + lam * weight_signs(flow, sides)
