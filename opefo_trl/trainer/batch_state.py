"""What the trainer keeps per micro-batch of TRL's, and the scores it is computed from (data only).

TRL shuffles the rollout batch and splits it into the micro-batch dicts it trains on (``GRPOTrainer._prepare_inputs``).
Each micro-batch's :class:`MicroBatchState` is written once per rollout and only read afterwards (TRL reuses the dicts
when ``num_iterations > 1``): a rollout weighed before the split carries it as per-row tensors
(``token_weights.CARRIED_STATE_KEYS``), shuffled and split with the rest of TRL's dict; one weighed after the split
holds it under ``STATE_KEY``. ``token_weights.micro_batch_state`` reads either. While a rollout batch is weighed,
each of its micro-batches is one :class:`RolloutItem` (``token_weights.py``, the `param` estimate and its probes), from
which the micro-batch's ``MicroBatchState`` is written. One scoring forward's statistics are :class:`Scores`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

STATE_KEY = "opefo"
#: Inputs the trainer's own scoring passes cannot feed (they score text only).
MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "num_images", "token_type_ids")


@dataclass
class Scores:
    """One scoring forward's per-token statistics of the completion tokens, (B, T) each: log pi_t and H_t, where the
    estimate or its bias diagnostic needs them the surprise-gap moments S_2 and S_3 (``VocabStats.moments``), and
    with ``entropy_flow_entropy='task_tokens'`` the entropy of the policy renormalised over the task's tokens."""

    logps: torch.Tensor
    entropies: torch.Tensor
    moment2: torch.Tensor | None = None
    moment3: torch.Tensor | None = None
    token_set_entropies: torch.Tensor | None = None

    @property
    def measured_entropies(self) -> torch.Tensor:
        """The entropy the `param` flow measures (and the audit re-measures): over the task's tokens, or H_t."""
        return self.entropies if self.token_set_entropies is None else self.token_set_entropies

    def detached(self) -> Scores:
        return self._map(torch.Tensor.detach)

    def _map(self, function) -> Scores:
        def apply(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else function(t)

        moment2, moment3 = map(apply, self.moments)
        return Scores(function(self.logps), function(self.entropies), moment2, moment3, apply(self.token_set_entropies))

    @property
    def moments(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.moment2, self.moment3


@dataclass(frozen=True)
class MicroBatchState:
    """What the rollout pass found for one micro-batch, read by its loss forward and the audit.

    ``advantages``: the unweighted GRPO advantages per token (B, T), fp32 (TRL's ``advantages`` then holds the
    weighted ones). ``factor`` / ``unit_flow``: f_t and u_t (``opefo_trl.maths.entropy_flow``) at the rollout's
    parameters; ``unit_bias``: E_pi[u_t] at each position (``entropy_flow.on_policy_mean``) where the bias diagnostic
    is computed. ``deferred``: the rollout is this one micro-batch, whose weights are computed from its training forward
    instead (same parameters, one forward fewer); factor and flow are then computed there too. ``audit_entropies``:
    the entropies before the update, taken in full precision by the `param` estimate (None: the audit takes the
    training forward's). ``served`` / ``gradient``: when the rollout pass already has the gradient of the loss TRL
    will apply (``token_weights.RolloutWeigher``), the loss forward takes log pi_t and H_t from ``served`` instead of
    running the model, and the first micro-batch writes ``gradient`` into the parameters' ``.grad``.
    """

    advantages: torch.Tensor
    factor: torch.Tensor | None = None
    unit_flow: torch.Tensor | None = None
    unit_bias: torch.Tensor | None = None
    deferred: bool = False
    audit_entropies: torch.Tensor | None = None
    served: Scores | None = None
    gradient: list[torch.Tensor] | None = None


@dataclass
class RolloutItem:
    """One micro-batch of a rollout being weighted: TRL's dict, its unweighted per-token advantages, and what the
    rollout pass finds for it (the scores, f_t, u_t and, with `param`, the full-precision entropies for the audit)."""

    batch: dict
    advantages: torch.Tensor
    scores: Scores | None = None
    full_precision: Scores | None = None  # the estimate's own (detached) scores of the micro-batch
    factor: torch.Tensor | None = None
    unit_flow: torch.Tensor | None = None
    unit_bias: torch.Tensor | None = None
    audit_entropies: torch.Tensor | None = None
