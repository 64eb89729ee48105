"""The task's tokens (``entropy_flow_task_tokens``): the `param` flow can measure the entropy over them
(``entropy_flow_entropy="task_tokens"``), and the diagnostics log the shares of the flow sampled outside them
(``opefo_trl.trainer.token_weights.MicroBatchWeigher``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from opefo_trl.methods import TokenMethod


def check_task_tokens(args: Any, method_class: type[TokenMethod]) -> None:
    """``entropy_flow_task_tokens`` and ``entropy_flow_entropy="task_tokens"``, before the model loads."""
    tokens = args.entropy_flow_task_tokens
    if tokens is not None and (
        not tokens or len(set(tokens)) != len(tokens) or any(not isinstance(t, int) or t < 0 for t in tokens)
    ):
        raise ValueError(
            f"entropy_flow_task_tokens must be distinct token ids >= 0 (e.g. those of the digits, from "
            f"tokenizer.convert_tokens_to_ids); got {tokens}."
        )
    if args.entropy_flow_entropy != "task_tokens":
        return
    if tokens is None:
        raise ValueError(
            "entropy_flow_entropy='task_tokens' measures the entropy over entropy_flow_task_tokens, which is not set: "
            "give the task's token ids (e.g. the digits'), or use entropy_flow_entropy='vocabulary'."
        )
    computes_param = args.entropy_flow_estimate == "param" and (
        method_class.needs_rollout_pass or args.entropy_flow_diagnostics
    )
    if not computes_param:
        raise ValueError(
            "entropy_flow_entropy='task_tokens' sets the entropy the 'param' flow measures, but this configuration "
            f"computes no 'param' flow (entropy_flow_estimate={args.entropy_flow_estimate!r}, method={args.method!r}). "
            "Set entropy_flow_estimate='param', or remove the option."
        )


def task_token_ids(args: Any, vocab_size: int, device: torch.device) -> torch.Tensor | None:
    """``entropy_flow_task_tokens`` as a tensor on ``device``, each checked against the model's vocabulary."""
    if args.entropy_flow_task_tokens is None:
        return None
    outside = [t for t in args.entropy_flow_task_tokens if t >= vocab_size]
    if outside:
        raise ValueError(
            f"entropy_flow_task_tokens {outside} are not token ids of this model (vocabulary of {vocab_size}); take "
            "them from its tokenizer, e.g. tokenizer.convert_tokens_to_ids([...])."
        )
    return torch.tensor(args.entropy_flow_task_tokens, dtype=torch.long, device=device)
