"""The algorithm's maths, torch only (no TRL import), to be read next to docs/algorithm.md.

- `entropy_flow`: the tabular per-token flow estimates, S+ / S-, lambda* and the token weights (sections 1-3).
- `lm_head`: log pi_t and H_t of the sampled tokens from final hidden states and the LM head, differentiable, in
  chunks of tokens (section 4); `core_model`, the causal LM under a PEFT wrapper.
- `options`: what the methods' options share: a settings field with its help, and the strict on-policy test.
- `order_stats`: the k-th largest value over data-parallel ranks, with sums only (section 11).
- `ranks`: `ReduceSum`, what sums a tensor over data-parallel ranks, and its single-process form.
- `vocab_stats`: the chunked full-vocabulary pass of the `full` estimate (section 1).

The maths of this library's own extensions (the `param` estimate, the step model) is in `opefo_trl.experimental`.
"""
