"""STEER: each token weighted down by the size of its first-order entropy change (docs/algorithm.md section 11)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from opefo_trl.maths.entropy_flow import check_choice
from opefo_trl.maths.order_stats import kth_largest
from opefo_trl.maths.ranks import ReduceSum, single_process_sum
from opefo_trl.methods.base import (
    SINGLE_PROCESS,
    MethodContext,
    RolloutWeights,
    TokenBatch,
    TokenMethod,
    TokenTerms,
    register_token_method,
    setting,
)

MAPPINGS = ("exp", "linear")
#: Omega_t: 'entropy_flow' is |d_t| of the configured entropy-flow estimate; 'published' the STEER code's
#: |A_t / pi_old * pi_t (1 - pi_t)(log pi_t + H_t)|.
OMEGAS = ("entropy_flow", "published")
#: The tokens Omega's extremes are taken over: every rank's whole rollout batch, or each micro-batch on its own rank
#: (the STEER code's, computed in the loss forward).
SCOPES = ("rollout_batch", "micro_batch")


def published_omega(batch: TokenBatch) -> torch.Tensor:
    """The STEER code's Omega_t = |A_t / pi_old,t * pi_t (1 - pi_t)(log pi_t + H_t)| = |A_t r_t (1 - pi_t)(log pi_t +
    H_t)|, float64 (B, T), with pi_t, H_t those of ``batch`` (the current policy) and r_t = pi_t / pi_old,t from
    ``batch.old_logps`` (1 where TRL tracks none: strictly on-policy pi_old = pi).

    >>> import math
    >>> batch = TokenBatch(logps=torch.tensor([[math.log(0.5)]]), entropies=torch.tensor([[1.0]]),
    ...                    advantages=torch.tensor([[2.0]]), factor=torch.ones(1, 1))
    >>> round(float(published_omega(batch)), 6)  # |2 * 0.5 * (ln 0.5 + 1)|
    0.306853
    """
    logps = batch.logps.double()
    ratio = torch.ones_like(logps) if batch.old_logps is None else torch.exp(logps - batch.old_logps.double())
    one_minus_pi = -torch.expm1(logps)  # 1 - pi without cancellation near pi = 1
    return (batch.advantages.double() * ratio * one_minus_pi * (logps + batch.entropies.double())).abs()


@register_token_method("steer")
class STEER(TokenMethod):
    """STEER: with Omega_t >= 0 the size of the token's entropy change (``steer_omega``), and Omega_max / Omega_min
    its largest / smallest over the tokens in the loss of the scope (``steer_scope``):

    - ``exp`` (default): w_t = max(exp(-k Omega_t), w_min), k = -ln(w_min) / max(Omega_max, floor): the token of
      largest change gets the floor w_min, a token of no change 1;
    - ``linear``: w_t = w_max - (Omega_t - Omega_min) (w_max - w_min) / (Omega_max - Omega_min), (w_min + w_max) / 2
      when every Omega is equal.

    ``steer_omega``: ``entropy_flow`` (default), |d_t| of the configured ``entropy_flow_estimate`` (``opefo``:
    |A (1 - pi)^2 (log pi + H)|); ``published``, the STEER code's |A / pi_old * pi (1 - pi)(log pi + H)|, at ratio 1
    |A (1 - pi)(log pi + H)| (``published_omega``).

    ``steer_scope``: ``rollout_batch`` (default), the extremes over the whole rollout batch on every rank, the weights
    made once per rollout batch at the rollout's parameters (there pi = pi_old: the ratio is 1); ``micro_batch``, as the
    STEER code: over each micro-batch on its own rank, remade in every loss forward from that forward's pi and H (and
    TRL's ``old_per_token_logps``, the rollout's, for pi_old), so after the first of several optimizer steps per
    rollout the ratio enters ``published`` and the weights follow the policy. With ``entropy_flow`` d_t is the
    rollout's in both scopes.
    """

    @dataclass
    class Settings:
        """Options of ``method="steer"``."""

        steer_mapping: str = setting(
            "exp", "STEER: 'exp' weights exp(-k Omega_t) down to the floor; 'linear' maps Omega_t onto [max, min]."
        )
        steer_weight_min: float = setting(
            0.8, "STEER: the floor w_min in (0, 1], the weight of the token of largest entropy change."
        )
        steer_weight_max: float = setting(
            1.2, "STEER, steer_mapping='linear': the weight w_max (>= steer_weight_min) of the token of least change."
        )
        steer_omega_floor: float = setting(
            0.02,
            "STEER, steer_mapping='exp': k = -ln(w_min) / max(largest Omega_t, this), so a batch whose changes are all "
            "small is not stretched to the floor.",
        )
        steer_omega: str = setting(
            "entropy_flow",
            "STEER: the size of a token's entropy change Omega_t. 'entropy_flow': |d_t| of entropy_flow_estimate; "
            "'published': the STEER code's |A / pi_old * pi (1 - pi)(log pi + H)| (at ratio 1 |A (1 - pi)(log pi + "
            "H)|), pi_old from TRL's old_per_token_logps (pi itself when TRL tracks none).",
        )
        steer_scope: str = setting(
            "rollout_batch",
            "STEER: the tokens Omega's largest and smallest are taken over. 'rollout_batch': the whole rollout batch "
            "on every rank, weights made once per rollout batch; 'micro_batch': each micro-batch on its own rank, "
            "weights remade in every loss forward from its pi and H (the STEER code's; results then depend on "
            "per_device_train_batch_size).",
        )

        def __post_init__(self):
            check_choice("steer_mapping", self.steer_mapping, MAPPINGS)
            check_choice("steer_omega", self.steer_omega, OMEGAS)
            check_choice("steer_scope", self.steer_scope, SCOPES)
            if not 0.0 < self.steer_weight_min <= 1.0:
                raise ValueError(f"steer_weight_min must lie in (0, 1]; got {self.steer_weight_min}.")
            if not (math.isfinite(self.steer_weight_max) and self.steer_weight_max >= self.steer_weight_min):
                raise ValueError(
                    f"steer_weight_max must be >= steer_weight_min={self.steer_weight_min}; got "
                    f"{self.steer_weight_max}."
                )
            if not (math.isfinite(self.steer_omega_floor) and self.steer_omega_floor > 0):
                raise ValueError(f"steer_omega_floor must be > 0; got {self.steer_omega_floor}.")

    settings: Settings
    summary = "tokens weighted down by the size of their entropy change"
    needs_rollout_pass = True
    table_rows = (
        (
            "STEER",
            '`method="steer"` ({defaults}); the size of the entropy change d_t from `entropy_flow_estimate` (`opefo`, '
            "`full`, `param`), or the STEER code's Omega and scope (`steer_omega='published'`, "
            "`steer_scope='micro_batch'`)",
        ),
    )

    def __init__(self, settings=None, **values) -> None:
        super().__init__(settings, **values)
        self._step_sums: torch.Tensor | None = None  # micro_batch scope: the step's weight sum, floor count, ...

    def omega(self, batch: TokenBatch) -> torch.Tensor:
        """Omega_t >= 0, float64 (B, T), as ``steer_omega`` says."""
        if self.settings.steer_omega == "published":
            return published_omega(batch)
        if batch.flow is None:
            raise ValueError("STEER needs the batch's entropy flow (TokenBatch.flow).")
        return batch.flow.detach().double().abs()

    def weigh(self, omega: torch.Tensor, in_loss: torch.Tensor, reduce_sum: ReduceSum) -> tuple[torch.Tensor, ...]:
        """The weights (fp32 (B, T)) of ``omega`` with its extremes over the tokens in the loss on every rank of
        ``reduce_sum``, and (weight sum, tokens at the floor, tokens, Omega_max) over them, float64 (4,)."""
        omega32 = omega.float()  # the extremes are found among float32 values (kth_largest)
        tokens = int(reduce_sum(in_loss.sum().to(torch.float64)))
        if tokens == 0:
            return torch.ones_like(omega32), torch.zeros(4, dtype=torch.float64, device=omega.device)
        largest = float(kth_largest(omega32, in_loss, 1, reduce_sum))
        w_min, w_max = self.settings.steer_weight_min, self.settings.steer_weight_max
        if self.settings.steer_mapping == "exp":
            k = -math.log(w_min) / max(largest, self.settings.steer_omega_floor)
            weights = torch.exp(-k * omega.double()).clamp(min=w_min, max=1.0)
        else:
            smallest = float(kth_largest(omega32, in_loss, tokens, reduce_sum))
            if largest > smallest:
                weights = w_max - (omega.double() - smallest) * ((w_max - w_min) / (largest - smallest))
            else:
                weights = torch.full_like(omega, (w_min + w_max) / 2, dtype=torch.float64)
            weights = weights.clamp(min=w_min, max=w_max)
        weights = weights.float()
        sums = reduce_sum(
            torch.stack([(weights.double() * in_loss).sum(), ((weights <= w_min) & in_loss).sum().double()])
        )
        return weights, torch.cat([sums, sums.new_tensor([tokens, largest])])

    def rollout_weights(self, batch: TokenBatch, context: MethodContext = SINGLE_PROCESS) -> RolloutWeights:
        if self.settings.steer_scope == "micro_batch":
            return RolloutWeights()  # made in each loss forward (micro_batch_terms)
        weights, sums = self.weigh(self.omega(batch), batch.in_loss, context.reduce_sum)
        self.metrics = self._metrics(sums, scopes=1) if sums[2] > 0 else {}
        return RolloutWeights(weights)

    def micro_batch_terms(
        self, batch: TokenBatch, logps: torch.Tensor, context: MethodContext = SINGLE_PROCESS
    ) -> TokenTerms:
        if self.settings.steer_scope == "rollout_batch":
            return TokenTerms()  # made for the whole rollout batch (rollout_weights)
        # This rank's micro-batch alone: no collective, as the STEER code's per-GPU micro-batch.
        weights, sums = self.weigh(self.omega(batch), batch.in_loss, single_process_sum)
        scopes = sums.new_tensor([float(sums[2] > 0)])
        step = torch.cat([sums, scopes])
        self._step_sums = step if self._step_sums is None else self._step_sums + step
        return TokenTerms(weights=weights)

    def on_optimizer_step(self, context: MethodContext = SINGLE_PROCESS) -> None:
        if self.settings.steer_scope == "rollout_batch":
            return
        if self._step_sums is None:  # no micro-batch seen this step
            return
        total, self._step_sums = context.reduce_sum(self._step_sums), None
        self.metrics = self._metrics(total[:4], scopes=float(total[4])) if total[2] > 0 else {}

    @staticmethod
    def _metrics(sums: torch.Tensor, scopes: float) -> dict[str, float]:
        """steer/weight_mean and steer/floor_frac over the tokens in the loss; steer/omega_max, the largest Omega of
        each scope (the rollout batch, or each micro-batch) averaged over the scopes."""
        tokens = float(sums[2])
        return {
            "steer/weight_mean": float(sums[0]) / tokens,
            "steer/floor_frac": float(sums[1]) / tokens,
            "steer/omega_max": float(sums[3]) / scopes,
        }
