"""`ExtensionHooks`: what `OPEFOTrainer` does for this library's extensions beyond the parts it builds
(`extension_parts`), as a mixin ahead of TRL's `GRPOTrainer` in its bases: the entropy audit's callback and the
batches it measures, and the `param` estimate's check of the optimizer. With the paper's options these are inert: the
audit is off (``entropy_flow_audit_steps=0``) and there is no `param` estimate.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opefo_trl.experimental.entropy_audit import EntropyAudit
    from opefo_trl.experimental.param_estimate import ParamEstimate
    from opefo_trl.trainer.token_weights import LossCall


class ExtensionHooks:
    """Mixed into `OPEFOTrainer` before `GRPOTrainer`; the trainer sets `audit` and `param_estimate` when it builds
    its parts, and calls `attach_extensions` then and `after_loss` after every training loss."""

    audit: EntropyAudit
    param_estimate: ParamEstimate | None
    args: Any

    def attach_extensions(self) -> None:
        """The audit measures around every optimizer step it is due at (a `TrainerCallback`)."""
        self.add_callback(self.audit)  # type: ignore[attr-defined]

    def after_loss(self, call: LossCall) -> None:
        """Keep the micro-batch's entropies before the step, for the audit's measured change after it."""
        if call.entropies_before is not None:
            self.audit.keep_batch(call.inputs, call.entropies_before, call.full_precision)

    def create_optimizer(self, *args, **kwargs):
        optimizer = super().create_optimizer(*args, **kwargs)
        if self.param_estimate is not None:  # its step model reproduces this optimizer's update
            self.param_estimate.check_optimizer(optimizer, self.args.entropy_flow_preconditioner)
        return optimizer
