"""Plain GRPO (weights 1, no extra term), and the baselines that are TRL's own options on top of it."""

from __future__ import annotations

from opefo_trl.methods.base import TokenMethod, register_token_method


@register_token_method("grpo")
class GRPO(TokenMethod):
    """GRPO as TRL computes it: every token weighted 1 (Entropy-Reg and Clip-higher are TRL's own options)."""

    summary = "plain GRPO; with TRL's options also Entropy-Reg and Clip-higher"
    table_rows = (
        ("GRPO, 8 updates per rollout", '`method="grpo"`, `steps_per_generation=8 * gradient_accumulation_steps`'),
        ("strict on-policy GRPO", '`method="grpo"`'),
        ("Entropy-Reg", '`method="grpo"`, `entropy_coef=1e-3` or `use_adaptive_entropy=True` (TRL\'s own)'),
        ("Clip-higher", '`method="grpo"`, `epsilon_high=0.28` (TRL\'s own; active only off-policy)'),
    )
