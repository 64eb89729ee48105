"""The algorithm's maths, torch only (no TRL import), to be read next to docs/algorithm.md.

- `entropy_flow`: the tabular per-token flow estimates, S+ / S-, lambda* and the token weights (sections 1-3).
- `param_flow`: the exact first-order flow through the network's parameters, u_t = <D grad Hbar, grad log pi_t>
  (section 4), with u_t by forward-mode AD (`param_jvp`).
- `param_jvp`: the Jacobian-vector product of theta -> (log pi_t, H_t)_t through the backbone and an exact LM-head
  formula in float64 (section 4).
- `step_model`: the optimizer's next update as a function of the gradient, and the exact step balance (section 4).
- `vocab_stats`: the chunked full-vocabulary pass of the `full` estimate (section 1).
"""
