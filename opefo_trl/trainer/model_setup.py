"""The policy's precision set-up and the checks that need the built trainer (accelerate's launch, the weights' dtype).

`cast_lm_head_to_fp32` (OPEFOConfig's default) asks TRL to project the LM head in float32. TRL 1.16 cannot do it in
two cases, handled here:

- a float64 head would be rounded down to float32: it is kept, and the option set False on the config (what the
  trainer then does);
- a PEFT model's tied head: TRL looks the input embeddings up as ``model.model.embed_tokens``, which a PeftModel lacks
  (an AttributeError on e.g. Qwen2.5-0.5B + LoRA). TRL reads the option only while it builds the trainer, so it is
  built without the cast (:func:`trl_builds_without_head_cast`) and :func:`cast_peft_lm_head_to_fp32` casts the base
  model's head afterwards, as TRL does for a plain model.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from accelerate.utils import is_peft_model
from trl import GRPOTrainer
from trl.trainer.utils import add_fused_lm_head

from opefo_trl.experimental.param_jvp import SUPPORTED_ATTENTION
from opefo_trl.maths.entropy_flow import TABULAR_ESTIMATES
from opefo_trl.trainer.config import check_estimate_backend

TRL_FUSED_HEAD_OUTPUTS = ("log_probs", "entropy")  # what GRPOTrainer (TRL 1.16) adds its fused head with


def has_float64_head(model: Any, args: Any) -> bool:
    """Whether the policy's LM head is (or will be loaded in) float64."""
    if isinstance(model, str):
        dtype = (getattr(args, "model_init_kwargs", None) or {}).get("dtype")
        return str(dtype).removeprefix("torch.") == "float64"
    head = model.get_output_embeddings()
    return head is not None and head.weight.dtype == torch.float64


def keep_float64_head(model: Any, args: Any) -> None:
    """A float64 head stays float64: ``cast_lm_head_to_fp32`` is set False (the cast would round it to float32)."""
    if has_float64_head(model, args):
        args.cast_lm_head_to_fp32 = False


def casts_peft_head(model: Any, args: Any, trl_arguments: tuple, trl_keywords: dict) -> bool:
    """Whether the head cast is the trainer's to make: a PEFT model (given, or built by TRL from ``peft_config``)."""
    bound = inspect.signature(GRPOTrainer.__init__).bind(None, model, *trl_arguments, **trl_keywords)
    given_peft = not isinstance(model, str) and is_peft_model(model)
    return bool(args.cast_lm_head_to_fp32) and (bound.arguments.get("peft_config") is not None or given_peft)


@contextmanager
def trl_builds_without_head_cast(args: Any, enabled: bool) -> Iterator[None]:
    """``cast_lm_head_to_fp32`` off while TRL builds the trainer (``enabled``: the PEFT case), restored afterwards."""
    wanted = args.cast_lm_head_to_fp32
    if enabled:
        args.cast_lm_head_to_fp32 = False
    try:
        yield
    finally:
        args.cast_lm_head_to_fp32 = wanted


def cast_peft_lm_head_to_fp32(base: Any, temperature: float) -> None:
    """The base model's LM head in float32 and TRL's fused head re-added with the cast (``base``: the PEFT model's
    base model, as TRL adds its fused head to it)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    head = base.get_output_embeddings()
    if isinstance(head, BaseTunerLayer):
        raise ValueError(
            "cast_lm_head_to_fp32=True (OPEFOConfig's default) cannot cast an LM head that carries a PEFT adapter "
            "(`target_modules` includes `lm_head`). Remove `lm_head` from the adapter's target modules, or set "
            "cast_lm_head_to_fp32=False (the entropy-flow statistics are then computed from half-precision logits)."
        )
    original_dtype = head.weight.dtype
    head.float()
    if base.config.get_text_config().tie_word_embeddings and original_dtype != torch.float32:
        # The tied embedding weights are float32 now too; the embeddings' outputs stay in the model's dtype.
        base.get_input_embeddings().register_forward_hook(lambda module, inputs, output: output.to(original_dtype))
    # Generation's (unfused) head runs in float32 outside autocast as well, as TRL's cast makes it.
    head.forward = lambda hidden: torch.nn.functional.linear(
        hidden.float(), head.weight.float(), None if head.bias is None else head.bias.float()
    )
    del base.forward  # the fused head TRL added without the cast (an attribute of the instance)
    add_fused_lm_head(base, temperature=temperature, cast_lm_head_to_fp32=True, outputs=TRL_FUSED_HEAD_OUTPUTS)


def refuse_unsupported_setup(
    args: Any,
    *,
    computes_flow: bool,
    rollout_param: bool,
    trainable: list[torch.Tensor],
    deepspeed: bool,
    fsdp: bool,
    main_process: bool,
    attention: str | None = "sdpa",
) -> None:
    """What the configuration alone could not tell: the launch backend (accelerate's state) for the estimate, a
    half-precision head under a tabular estimate (warned), and for `param` the trainable weights' dtype and the
    attention implementation.

    ``computes_flow``: the entropy flow is computed (a rollout method, or the diagnostics); ``rollout_param``: the
    `param` estimate runs over every rollout batch; ``attention``: the policy's attention implementation.
    """
    estimate = args.entropy_flow_estimate
    if computes_flow:
        check_estimate_backend(estimate, deepspeed=deepspeed, fsdp=fsdp)
    if (
        computes_flow
        and estimate in TABULAR_ESTIMATES
        and (args.bf16 or args.fp16)
        and not args.cast_lm_head_to_fp32
        and main_process
    ):
        warnings.warn(
            f"entropy_flow_estimate={estimate!r} with a {'bf16' if args.bf16 else 'fp16'} LM head: "
            "the log-probs and entropies of the entropy-flow statistics are rounded to half precision, which was "
            "measured to move lambda* by up to ~1e-3 (the size of the paper's lambda*). Set "
            "cast_lm_head_to_fp32=True (OPEFOConfig's default; on a GRPOConfig: args.cast_lm_head_to_fp32 = True).",
            stacklevel=4,
        )
    if not rollout_param:
        return
    imprecise = sorted(str(d) for d in {p.dtype for p in trainable} - {torch.float32, torch.float64})
    if imprecise:
        raise ValueError(
            f"entropy_flow_estimate='param' differentiates the policy in float32 or float64, but the trainable "
            f"parameters are {imprecise}. Load the model in float32 (dtype='float32'; bf16 mixed precision, "
            "bf16=True, still speeds up the training forward while the estimate's own passes run in float32), or "
            "use a log-prob estimate."
        )
    if attention not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"entropy_flow_estimate='param' takes forward-mode derivatives through the attention, which "
            f"attn_implementation={attention!r} has no rule for. Load the model with attn_implementation='sdpa' "
            "(transformers' default; opefo-train: --attn_implementation sdpa) or 'eager', or use a log-prob estimate."
        )
