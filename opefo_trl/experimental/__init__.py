"""This library's own research beyond the paper; the paper's method (`method="opefo"` with a tabular estimate,
docs/algorithm.md sections 1-3) does not need any of it.

- `param_flow`: the `param` estimate's exact first-order flow through the network's parameters,
  u_t = <D grad Hbar, grad log pi_t>, and its checks (section 4), with u_t by forward-mode AD (`param_jvp`).
- `param_jvp`: the Jacobian-vector product of theta -> (log pi_t, H_t)_t through the backbone and an exact LM-head
  formula in float64 (section 4).
- `param_estimate`: the trainer's side of the `param` estimate: its scoring and forward-mode passes over the
  micro-batches.
- `optimizer`: the optimizer's update as a function of the gradient, as torch computes it (Adam/AdamW, SGD), Adam's
  preconditioner D, and fp64 inner products of parameter lists (section 4).
- `step_model`: the first-order entropy change of the real next AdamW step, and its root in lambda (section 4).
- `opefo_step`: OPEFO's step balance and entropy setpoint (``opefo_balance="step"``, ``opefo_entropy_target``).
- `fixed_probe`: a fixed probe of prompts never trained on, whose entropy the `param` flow measures too.
- `entropy_audit`: the callback that measures what an optimizer step really did to its batch's entropy
  (``entropy_flow_audit_steps``).
- `stand_ins`: the two places the trainer stands in for TRL's own pass under the step balance.
- `task_tokens`: the task's token ids (``entropy_flow_task_tokens``), checked with the config and against the model's
  vocabulary; the `param` flow can measure the entropy over them (``entropy_flow_entropy="task_tokens"``).
- `extension_parts`: how the trainer builds the parts above (`param` estimate, fixed probe, audit) from its settings,
  for `opefo_trl.trainer.parts.build_parts`.
- `trainer_hooks`: `ExtensionHooks`, the mixin with the extensions' trainer hooks (the audit's callback and the
  batches it measures, the `param` estimate's check of the optimizer).

Each module is imported by its path, e.g. ``from opefo_trl.experimental.param_flow import ParamFlowEstimator``.
"""
