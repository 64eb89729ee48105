"""The algorithm's maths, torch only (no TRL import), to be read next to docs/algorithm.md.

- `entropy_flow`: the tabular per-token flow estimates, S+ / S-, lambda* and the token weights (sections 1-3).
- `lm_head`: log pi_t and H_t of the sampled tokens from final hidden states and the LM head, differentiable, in
  chunks of tokens (section 4).
- `optimizer`: the optimizer's update as a function of the gradient, as torch computes it (Adam/AdamW, SGD), Adam's
  preconditioner D, and fp64 inner products of parameter lists (section 4).
- `order_stats`: the k-th largest value over data-parallel ranks, with sums only (section 11).
- `param_flow`: the exact first-order flow through the network's parameters, u_t = <D grad Hbar, grad log pi_t>
  (section 4), with u_t by forward-mode AD (`param_jvp`).
- `param_jvp`: the Jacobian-vector product of theta -> (log pi_t, H_t)_t through the backbone and an exact LM-head
  formula in float64 (section 4); `core_model`, the causal LM under a PEFT wrapper.
- `ranks`: `ReduceSum`, what sums a tensor over data-parallel ranks, and its single-process form.
- `step_model`: the first-order entropy change of the real next optimizer step, and the exact step balance
  (section 4).
- `vocab_stats`: the chunked full-vocabulary pass of the `full` estimate (section 1).
"""
