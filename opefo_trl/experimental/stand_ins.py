"""The two places where the trainer stands in for TRL's own computation, both used only with the step balance
(``opefo_balance="step"``, `param` estimate) when the rollout pass already has the gradient of the loss TRL will apply.

- :func:`served_scores`, the leaf handed to TRL's loss: TRL's scoring call in the loss forward
  (``_get_per_token_logps_and_entropies``) returns the estimate's detached log pi_t, made a leaf that requires grad,
  and H_t, instead of running the model. TRL's loss, its metrics (loss, entropy, clip ratios) and the one-time guard
  are computed from it as from its own forward; its backward reaches no parameter. Exact when the estimate's scores
  are those TRL's forward would give: the same parameters (on-policy: one optimizer step per rollout batch, refused
  otherwise by ``opefo_step.check_step_config``), float32 or better (the `param` estimate's full-precision forward;
  TRL's metrics then agree to float32 rounding).
- :func:`write_gradient`, the gradient written into ``p.grad``: g = a + lambda b of the step model
  (``ParamEstimate.finish``), added once, on the first micro-batch of the step, to what the backward of the leaf
  leaves (nothing). Exact when TRL's loss is linear in the token weights with no other term: the gradient is then
  -sum_t f_t A_t w_t grad log pi_t with w_t = 1 + lambda s_t, which is a + lambda b. Guarded by: the method declaring
  its weights 1 + lambda s_t with the signs of the step model it built (``RolloutWeights.lam`` / ``signs``; any other
  form and TRL's pass runs); ``LossMirror.gradient_is_linear`` and no micro-batch terms (``trainer.parts.build_parts``
  sets ``RolloutWeigher.writes_gradient``); the step balance's refusals of a KL term, an entropy bonus and off-policy
  updates (``opefo_step.check_step_config``); the optimizer check (``ParamEstimate.check_optimizer``); and the
  one-time guard ``LossMirror.check_against_trl`` on the first micro-batch, which stops training with
  ``LossMirrorMismatch`` when TRL's loss has another gradient in log pi_t than the factor models.

Pinned against TRL's own pass by tests/experimental/test_param_estimate.py:
``test_the_written_gradient_is_the_one_trls_own_pass_computes`` (every loss type: the written gradient against TRL's
training pass, and TRL's logged loss and entropy from the served leaf against its own forward's) and
``test_the_written_gradient_carries_the_vllm_importance_ratio`` (with TRL's vLLM importance-sampling correction).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from opefo_trl.trainer.batch_state import Scores


def served_scores(served: Scores) -> tuple[torch.Tensor, torch.Tensor, None]:
    """What TRL's scoring call in the loss forward returns instead of running the model, from the estimate's scores of
    the micro-batch (``MicroBatchState.served``): log pi_t as a leaf TRL's loss backpropagates into, reaching no
    parameter, and H_t."""
    return served.logps.detach().requires_grad_(True), served.entropies, None


def write_gradient(params: Sequence[torch.Tensor], gradient: Sequence[torch.Tensor]) -> None:
    """Add the rollout's whole gradient to the parameters' ``.grad`` (once per optimizer step)."""
    for p, g in zip(params, gradient, strict=True):
        p.grad = g if p.grad is None else p.grad.add_(g)
