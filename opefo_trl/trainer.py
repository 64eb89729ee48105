"""`OPEFOTrainer`: TRL's `GRPOTrainer` with a pluggable token-level method (OPEFO by default).

Where the algorithm touches TRL, and why there (the least copied TRL code for the exact algorithm):

1. `_generate_and_score_completions` + `_prepare_inputs` (once per rollout batch): for methods that need the whole
   rollout batch before the first backward (OPEFO's lambda*) and for the `param` estimate, take log pi_t and H_t
   of the current policy (from TRL's own no-grad scoring pass when it runs one, else one no-grad pass of ours, or,
   for a rollout batch that is a single micro-batch, the training forward itself), compute for every micro-batch
   TRL will train on the per-token factor its loss applies (masks, normalisation, vLLM importance weights) and the
   per-token entropy flow, let the method turn them into detached fp32 token weights (its sums all-reduced over
   ranks), and store `advantages * weights` as (B, T) advantages in each micro-batch. TRL accepts (B, T) advantages
   everywhere, and since the weights are >= 0 this is exactly the reweighted loss for every loss type.
2. `_get_per_token_logps_and_entropies` (every scoring forward): captures those statistics, and, for the `full`
   estimate, the final hidden states, from which a chunked pass over the (ZeRO-3 gathered) LM head computes
   sum pi^2 and sum pi^2 log pi without materialising [tokens, vocab] logits.
3. `_compute_loss` (every micro-batch): calls TRL's own loss on a copy of the inputs whose advantages the method
   may weight (PAR, Clip-Cov) from the current log-probs, adds the method's extra per-token loss (KL-Cov) aggregated
   like TRL's policy loss, accumulates the entropy-flow diagnostics, and at the optimizer-step boundary updates
   method controllers (PAR) and logs. TRL's `_compute_loss` is called, never copied, so its metrics keep flowing.
4. Around the optimizer step (callbacks): every `entropy_flow_audit_steps` steps, re-score that step's batch and log
   the measured change of its mean token entropy; with `param`, also the first-order change predicted from the
   real gradient before the step and the one of the real parameter change after it.

Ordering TRL must keep (pinned by tests/test_trainer.py; check it on every TRL upgrade, CONTRIBUTING.md): in
`GRPOTrainer._compute_loss`, the per-token log-probs are computed (through `_get_per_token_logps_and_entropies`)
*before* `inputs["advantages"]` is read, because the token method writes its weights into the advantages inside
that call (the weights of deferred rollouts and of PAR / Clip-Cov depend on the training forward's log-probs).

All the library's own forwards (the rollout scoring pass, the `param` estimate's passes, the audit's re-score) go
through one helper, `_score`; the override of `_get_per_token_logps_and_entropies` only observes the calls TRL makes
(its old-log-prob pass and the loss forward).

Example:
    >>> from opefo_trl import OPEFOConfig, OPEFOTrainer
    >>> from trl.rewards import accuracy_reward
    >>> trainer = OPEFOTrainer(  # doctest: +SKIP
    ...     model="Qwen/Qwen2.5-Math-1.5B",
    ...     reward_funcs=accuracy_reward,
    ...     args=OPEFOConfig(output_dir="opefo-run", method="opefo"),
    ...     train_dataset=dataset,
    ... )
    >>> trainer.train()  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from ._compat import check_trl_version

check_trl_version()

from accelerate.utils import is_peft_model  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.models.utils import disable_gradient_checkpointing  # noqa: E402
from trl.trainer.utils import (  # noqa: E402
    add_fused_lm_head,
    get_config_model_id,
    is_async_callable,
    maybe_gather_lm_head_ctx,
)

from .checks import RewardCheck, check_training_values  # noqa: E402
from .config import OPEFOConfig, check_estimate_backend, with_opefo_settings  # noqa: E402
from .entropy_flow import TABULAR_ESTIMATES, FlowStats, flow_per_unit_advantage, flow_stats  # noqa: E402
from .methods import TokenBatch, TokenMethod, get_token_method_class  # noqa: E402
from .param_flow import (  # noqa: E402
    ParamFlow,
    ParamFlowEstimator,
    check_optimizer,
    first_order_change,
    inner,
    warn_imprecise,
)
from .runs import EpochSeededSampler  # noqa: E402
from .vocab_stats import vocab_stats  # noqa: E402

METHOD_STATE_NAME = "opefo_method_state.json"
#: Keys this trainer adds to TRL's micro-batch dicts (they ride along TRL's shuffle and split).
ROLLOUT_STATS = ("opefo_logps", "opefo_entropies", "opefo_sum_sq_probs", "opefo_sum_sq_probs_log_probs")
UNIT_FLOW, FACTOR, ADVANTAGES = "opefo_unit_flow", "opefo_factor", "opefo_advantages"
#: The per-token entropies an audited step's batch had before the update, and the precision they were scored in.
AUDIT_ENTROPIES, AUDIT_FULL_PRECISION = "opefo_audit_entropies", "opefo_audit_full_precision"
TRL_FUSED_HEAD_OUTPUTS = ("log_probs", "entropy")  # what GRPOTrainer (TRL 1.16) adds its fused head with
MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "num_images", "token_type_ids")


def _logit_scale(text_config) -> float:
    """The multiplier TRL's fused head applies to the logits (same lookup as `trl.trainer.utils.add_fused_lm_head`)."""
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        if getattr(text_config, name, None) is not None:
            return getattr(text_config, name)
    if getattr(text_config, "logits_scaling", None) is not None:
        scaling = text_config.logits_scaling
        return scaling if text_config.model_type == "hyperclovax" else 1 / scaling
    return 1.0


def _per_token(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return advantages.unsqueeze(1).expand_as(like) if advantages.dim() == 1 else advantages


def _sequence(batch: dict) -> tuple[torch.Tensor, torch.Tensor, int]:
    """input_ids, attention_mask and completion length of a TRL micro-batch."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    return input_ids, attention_mask, batch["completion_ids"].size(1)


@dataclass
class Scores:
    """One scoring forward's per-token statistics of the completion tokens, (B, T) each."""

    logps: torch.Tensor
    entropies: torch.Tensor
    sum_sq_probs: torch.Tensor | None = None
    sum_sq_probs_log_probs: torch.Tensor | None = None

    def as_rollout_stats(self) -> dict[str, torch.Tensor]:
        values = (self.logps, self.entropies, self.sum_sq_probs, self.sum_sq_probs_log_probs)
        return {key: value.detach() for key, value in zip(ROLLOUT_STATS, values, strict=True) if value is not None}


def _has_float64_head(model, args) -> bool:
    """Whether the policy's LM head is (or will be loaded in) float64."""
    if isinstance(model, str):
        dtype = (getattr(args, "model_init_kwargs", None) or {}).get("dtype")
        return str(dtype).removeprefix("torch.") == "float64"
    head = model.get_output_embeddings()
    return head is not None and head.weight.dtype == torch.float64


class _AroundOptimizerStep(TrainerCallback):
    """The entropy audit: just before `optimizer.step()` (gradients clipped) and right after it (before the scheduler
    moves the learning rate)."""

    def __init__(self, trainer: OPEFOTrainer):
        self.trainer = trainer

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.trainer._before_optimizer_step()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.trainer._audit_optimizer_step()


class OPEFOTrainer(GRPOTrainer):
    """A drop-in [`~trl.GRPOTrainer`] whose per-token policy-gradient terms are weighted by a token method.

    Takes exactly `GRPOTrainer`'s arguments (`reward_funcs` optional with an `environment_factory` that owns the
    reward; `args=None`: `GRPOConfig`'s defaults in `<model>-GRPO`, as `GRPOTrainer` names it). `args` is an
    [`OPEFOConfig`], or a `GRPOConfig` (or subclass), which is kept as it is (same object, class and fields) and given
    the OPEFO options with their defaults (`method="opefo"`). What reward functions return is checked on every call
    (`opefo_trl.checks`), and each epoch's data order follows from the seed and the epoch (`opefo_trl.runs`).
    Logged on top of TRL's metrics: `entropy_flow/{lambda,increase,decrease,net,increase_token_frac,
    decrease_token_frac}` (with `entropy_flow_diagnostics`), `entropy_flow/measured_delta` (with
    `entropy_flow_audit_steps`; with `param` also `entropy_flow/{predicted_delta,step_first_order}`),
    `entropy_flow/{param_check_error,param_lambda_error}` (`param` estimate), and each method's own (`opefo/*`,
    `par/*`, `clip_cov/*`, `kl_cov/*`); all reduced over ranks.
    """

    _tag_names = ["trl", "grpo", "opefo"]
    _name = "OPEFO"
    #: An `OPEFOConfig`, or a `GRPOConfig` given every OPEFO option by `with_opefo_settings`.
    args: OPEFOConfig

    def __init__(self, model, reward_funcs=None, args: OPEFOConfig | GRPOConfig | None = None, *pargs, **kwargs):
        if args is None:  # the output_dir GRPOTrainer (TRL 1.16) defaults to, so that swapping the class moves nothing
            name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = OPEFOConfig(output_dir=f"{name.split('/')[-1]}-GRPO")
        args = with_opefo_settings(args)
        check_training_values(args)
        self.token_method: TokenMethod = get_token_method_class(args.method).from_config(args)
        self.flow_estimate: str = args.entropy_flow_estimate
        # The flow of the whole rollout batch is needed before the first backward.
        self._rollout_flow = self.token_method.needs_rollout_pass or (
            args.entropy_flow_diagnostics and self.flow_estimate == "param"
        )
        # Per-call state of the hooks below (None when inactive).
        self._rollout_capture: dict | None = None  # TRL's old-log-prob pass of the rollout batch being generated
        self._rollout_pending = False  # a new rollout batch was generated and awaits its weights
        self._weights_deferred = False  # rollout weights to be computed from the (single) training micro-batch
        self._loss_inputs: dict | None = None  # the micro-batch whose loss is being computed
        self._extra_loss: torch.Tensor | None = None
        self._hidden_chunks: list[torch.Tensor] | None = None
        # Sums over the micro-batches of the current optimizer step (reduced over ranks at its end).
        self._step_flow: FlowStats | None = None  # flow of the unweighted (GRPO) update
        self._step_batches: list[dict] = []  # the audited step's micro-batches, with their entropies before it
        self._param_flow: ParamFlow | None = None  # the `param` estimate of the step being audited (grad Hbar)
        self._audit_before: dict[str, float] = {}  # figures taken just before the audited optimizer step
        self._warned_imprecise = False
        # TRL's cast_lm_head_to_fp32 would round a float64 head down to float32, and TRL 1.16 cannot cast a PEFT
        # model's tied head (it looks the embeddings up as `model.model.embed_tokens`): the first keeps its float64
        # head, the second is cast here on the base model.
        wants_cast = args.cast_lm_head_to_fp32
        if _has_float64_head(model, args):
            args.cast_lm_head_to_fp32 = wants_cast = False
        bound = inspect.signature(GRPOTrainer.__init__).bind(self, model, reward_funcs, args, *pargs, **kwargs)
        given_peft = not isinstance(model, str) and is_peft_model(model)
        cast_peft_head = wants_cast and (bound.arguments.get("peft_config") is not None or given_peft)
        args.cast_lm_head_to_fp32 = wants_cast and not cast_peft_head
        try:
            super().__init__(model, reward_funcs, args, *pargs, **kwargs)
        finally:
            args.cast_lm_head_to_fp32 = wants_cast
        if cast_peft_head:
            self._cast_peft_lm_head_to_fp32()
        self._refuse_unsupported_setup()
        self.add_callback(_AroundOptimizerStep(self))

    # ----------------------------------------------------------------------------------------------------------------
    # Small helpers
    # ----------------------------------------------------------------------------------------------------------------

    def _reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(tensor, reduction="sum")

    def _log_metrics(self, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self._metrics["train"][name].append(value)

    def _core_model(self):
        """The causal LM carrying the fused head (unwrapped from DDP/DeepSpeed and PEFT)."""
        core = self.accelerator.unwrap_model(self.model)
        return core.get_base_model() if hasattr(core, "get_base_model") else core

    def _trainable_parameters(self) -> list[torch.Tensor]:
        return [p for p in self.accelerator.unwrap_model(self.model).parameters() if p.requires_grad]

    def _torch_optimizer(self):
        return getattr(self.optimizer, "optimizer", self.optimizer)  # inside accelerate's AcceleratedOptimizer

    def _cast_peft_lm_head_to_fp32(self) -> None:
        """`cast_lm_head_to_fp32` for a PEFT model: its base model's head in float32 and the fused head re-added with
        the cast. TRL 1.16 looks the tied input embeddings up as `model.model.embed_tokens`, which a PEFT model lacks
        (an AttributeError on e.g. Qwen2.5-0.5B + LoRA), so the trainer was built without the cast and it is done here,
        as TRL does it for a plain model."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        base = self._core_model()
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
        add_fused_lm_head(base, temperature=self.temperature, cast_lm_head_to_fp32=True, outputs=TRL_FUSED_HEAD_OUTPUTS)

    def _refuse_unsupported_setup(self) -> None:
        """What the configuration alone could not tell (accelerate's launch config, the weights' dtype)."""
        uses_estimate = self._rollout_flow or self.args.entropy_flow_diagnostics
        if uses_estimate:
            check_estimate_backend(self.flow_estimate, deepspeed=self.is_deepspeed_enabled, fsdp=self.is_fsdp_enabled)
        if (
            uses_estimate
            and self.flow_estimate in TABULAR_ESTIMATES
            and (self.args.bf16 or self.args.fp16)
            and not self.args.cast_lm_head_to_fp32
            and self.accelerator.is_main_process
        ):
            warnings.warn(
                f"entropy_flow_estimate={self.flow_estimate!r} with a {'bf16' if self.args.bf16 else 'fp16'} LM head: "
                "the log-probs and entropies of the entropy-flow statistics are rounded to half precision, which was "
                "measured to move lambda* by up to ~1e-3 (the size of the paper's lambda*). Set "
                "cast_lm_head_to_fp32=True (OPEFOConfig's default; on a GRPOConfig: args.cast_lm_head_to_fp32 = True).",
                stacklevel=3,
            )
        if self.flow_estimate != "param" or not self._rollout_flow:
            return
        dtypes = {p.dtype for p in self._trainable_parameters()}
        imprecise = sorted(str(d) for d in dtypes - {torch.float32, torch.float64})
        if imprecise:
            raise ValueError(
                f"entropy_flow_estimate='param' takes finite differences of float32 forwards, but the trainable "
                f"parameters are {imprecise}. Load the model in float32 (dtype='float32'; bf16 mixed precision, "
                "bf16=True, still speeds up the training forward while the estimate's own passes run in float32), or "
                "use a log-prob estimate."
            )

    def _loss_mask(self, batch: dict) -> torch.Tensor:
        mask = batch["completion_mask"]
        return mask * batch["tool_mask"] if "tool_mask" in batch else mask

    def _loss_normaliser(self, mask: torch.Tensor, inputs: dict) -> torch.Tensor:
        """c with TRL's policy loss = sum_t per_token_loss_t * mask_t * c_t for the configured loss type (broadcastable
        to (B, T)); the one place that mirrors TRL 1.16's aggregation (`GRPOTrainer._compute_loss`)."""
        accumulation = self.current_gradient_accumulation_steps
        batch_size = mask.size(0)
        one = torch.ones((), device=mask.device)
        if self.loss_type in ("grpo", "sapo"):
            return 1.0 / (mask.sum(-1, keepdim=True).clamp(min=1.0) * batch_size * accumulation)
        if self.loss_type == "bnpo":
            return one / (mask.sum().clamp(min=1.0) * accumulation)
        if self.loss_type == "dr_grpo":
            assert self.max_completion_length is not None, "loss_type='dr_grpo' normalises by max_completion_length"
            return one / (batch_size * self.max_completion_length * accumulation)
        if self.loss_type in ("cispo", "dapo", "vespo"):
            assert self.args.steps_per_generation is not None  # GRPOConfig.__post_init__ fills it
            normaliser = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            return one / (normaliser * accumulation / self.args.steps_per_generation)
        if self.loss_type == "luspo":
            return one / (batch_size * accumulation)
        raise ValueError(f"Loss type {self.loss_type!r} is not supported by OPEFOTrainer.")

    def _aggregate_like_policy_loss(self, per_token: torch.Tensor, mask: torch.Tensor, inputs: dict) -> torch.Tensor:
        """Reduce a per-token loss term exactly as TRL reduces the policy loss for the configured loss type."""
        return (per_token * mask * self._loss_normaliser(mask, inputs)).sum()

    @torch.no_grad()
    def _loss_factor(self, inputs: dict, logps: torch.Tensor, entropies: torch.Tensor) -> torch.Tensor:
        """f_t: the coefficient of A_t grad log pi_t in the (rank-averaged) gradient of TRL's loss, at the rollout's
        parameters (ratio 1). Loss and tool masks, the loss type's normalisation, the vLLM importance-sampling ratio
        (VESPO's gamma weights instead), the off-policy and high-entropy masks, CISPO's clamp. (B, T), fp32."""
        mask = self._loss_mask(inputs).float()
        factor = mask * self._loss_normaliser(mask, inputs) / self.accelerator.num_processes
        advantages = inputs.get(ADVANTAGES, inputs["advantages"])
        advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        old_logps = inputs.get("old_per_token_logps")
        old_logps = logps if old_logps is None else old_logps
        if self.off_policy_mask_threshold is not None:
            sampling_logps = inputs.get("sampling_per_token_logps", old_logps)
            factor = factor * self.get_off_policy_mask(
                advantages, logps, sampling_logps, mask, self.off_policy_mask_threshold
            )
        if self.top_entropy_quantile < 1.0:
            factor = factor * self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
        if self.loss_type == "vespo":
            args = self.args
            factor = factor * self.get_gamma_weights(
                advantages, logps - old_logps, mask, inputs.get("importance_sampling_ratio"),
                args.vespo_k_pos, args.vespo_lambda_pos, args.vespo_k_neg, args.vespo_lambda_neg,
            )  # fmt: skip
        elif self.use_vllm and self.vllm_importance_sampling_correction:
            factor = factor * inputs["importance_sampling_ratio"]
        if self.loss_type == "cispo":
            factor = factor * (logps - old_logps).exp().clamp(max=self.epsilon_high)
        return factor.float().expand_as(logps)

    # ----------------------------------------------------------------------------------------------------------------
    # Scoring: the library's own forwards (one helper), and the hidden states of the `full` estimate
    # ----------------------------------------------------------------------------------------------------------------

    def _needs_vocab_stats(self, in_loss: bool) -> bool:
        if self.flow_estimate != "full":
            return False
        if in_loss:
            return self._weights_deferred or (self.args.entropy_flow_diagnostics and not self._rollout_flow)
        return self._rollout_flow

    @contextmanager
    def _capture_hidden_states(self, enabled: bool):
        """Collect the backbone's final hidden states of every forward inside the block (no second backbone pass).
        The hook lives only for the block."""
        if not enabled:
            yield None
            return

        def keep(module, args, output):
            hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
            self._hidden_chunks.append(hidden.detach())

        chunks: list[torch.Tensor] = []
        self._hidden_chunks = chunks
        handle = self._core_model().base_model.register_forward_hook(keep)
        try:
            yield chunks
        finally:
            handle.remove()
            self._hidden_chunks = None

    @torch.no_grad()
    def _completion_vocab_stats(self, hidden: torch.Tensor, logits_to_keep: int):
        """sum pi^2 and sum pi^2 log pi at the completion positions, (B, T), from hidden states and the LM head, in
        the precision of TRL's fused head (its autocast dtype, or fp32 with `cast_lm_head_to_fp32`)."""
        core = self._core_model()
        text_config = core.config.get_text_config()
        head = core.get_output_embeddings()
        # Position i predicts token i + 1: the completion's T tokens are predicted from hidden[-T-1:-1].
        hidden = hidden[:, -logits_to_keep - 1 : -1]
        device_type = hidden.device.type
        if self.args.cast_lm_head_to_fp32:
            compute_dtype = torch.float32
        else:
            with self.accelerator.autocast():
                autocast_on = torch.is_autocast_enabled(device_type)
                compute_dtype = torch.get_autocast_dtype(device_type) if autocast_on else hidden.dtype
        with maybe_gather_lm_head_ctx(head.weight, head.bias):
            stats = vocab_stats(
                hidden,
                head.weight,
                head.bias,
                temperature=self.temperature,
                logit_scale=_logit_scale(text_config),
                softcap=getattr(text_config, "final_logit_softcapping", None),
                compute_dtype=compute_dtype,
                token_chunk_size=self.args.vocab_stats_token_chunk_size,
                vocab_chunk_size=self.args.vocab_stats_vocab_chunk_size,
            )
        return stats.sum_sq_probs, stats.sum_sq_probs_log_probs

    def _vocab_stats_of(self, chunks, logits_to_keep: int) -> tuple:
        return self._completion_vocab_stats(torch.cat(chunks), logits_to_keep) if chunks else (None, None)

    def _score(self, batch: dict, *, full_precision: bool = False, vocab: bool = False) -> Scores:
        """The policy's statistics of a micro-batch's completion tokens, by one of two forwards:

        - the default: TRL's no-grad scoring path in the training precision (with ``vocab``, for `full`, also the
          vocabulary sums from the hidden states of the same forward);
        - ``full_precision``: the fused forward in the parameters' own precision (float32/float64) with autocast off,
          differentiable when grad is enabled, as the `param` estimate needs. Accelerate's mixed-precision wrapper
          re-enables autocast inside `model.forward`, so the forward it wraps is called.
        """
        input_ids, attention_mask, length = _sequence(batch)
        kwargs = self.args.gradient_checkpointing_kwargs
        assert not isinstance(kwargs, str)  # TrainingArguments.__post_init__ parses a JSON string into a dict
        if full_precision:
            model = self.accelerator.unwrap_model(self.model)
            forward = getattr(model, "_original_forward", model.forward)
            labels = input_ids.masked_fill(attention_mask == 0, -100)
            labels[:, :-length] = -100  # only the completion is scored, as in TRL
            # torch.autograd.grad works through non-reentrant checkpointing (transformers 5's default), not reentrant.
            keep_checkpointing = torch.is_grad_enabled() and not (kwargs or {}).get("use_reentrant")
            # TRL annotates the model as a PreTrainedModel; a PEFT-wrapped one works the same.
            checkpointing = (
                nullcontext() if keep_checkpointing else disable_gradient_checkpointing(self.model, kwargs)  # type: ignore[arg-type]
            )
            with checkpointing, torch.autocast(input_ids.device.type, enabled=False):
                output = forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
            return Scores(output.log_probs[:, -length:], output.entropy[:, -length:])
        with (
            torch.no_grad(),
            disable_gradient_checkpointing(self.model, kwargs),  # type: ignore[arg-type]  # as above
            self._capture_hidden_states(vocab and self._needs_vocab_stats(False)) as chunks,
        ):
            logps, entropies, _ = GRPOTrainer._get_per_token_logps_and_entropies(
                self,
                self.model,
                input_ids,
                attention_mask,
                length,
                batch_size=self.args.per_device_train_batch_size,
                compute_entropy=True,
            )
        return Scores(logps, entropies, *self._vocab_stats_of(chunks, length))

    def _score_full_precision(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(log pi_t, H_t) of ``_score(batch, full_precision=True)``: the `param` estimator's scoring function."""
        scores = self._score(batch, full_precision=True)
        return scores.logps, scores.entropies

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, **kwargs
    ):
        """Observes the scoring calls TRL makes: its old-log-prob pass over a new rollout (statistics captured) and the
        loss forward (the token method applied). Every other call is TRL's own."""
        # The first scoring call of a rollout on the policy itself is TRL's old-log-prob pass (the reference pass,
        # when there is one, comes after it).
        capture = (
            self._rollout_capture is not None and "scores" not in self._rollout_capture and model is not self.ref_model
        )
        in_loss = self._loss_inputs is not None  # the loss scores only the policy (possibly DDP/DeepSpeed-wrapped)
        if not (capture or in_loss):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, **kwargs
            )
        with self._capture_hidden_states(self._needs_vocab_stats(in_loss)) as chunks:
            logps, entropies, aux_loss = super()._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size=batch_size,
                compute_entropy=compute_entropy or capture,
                **kwargs,
            )
        vocab = self._vocab_stats_of(chunks, logits_to_keep)
        if capture:
            self._rollout_capture["scores"] = Scores(logps.detach(), entropies.detach(), *vocab)
        else:
            self._apply_token_method(logps, entropies, vocab)
        return logps, entropies, aux_loss

    # ----------------------------------------------------------------------------------------------------------------
    # Hook 1: once per rollout batch
    # ----------------------------------------------------------------------------------------------------------------

    def _trl_scores_rollout(self) -> bool:
        """Whether GRPOTrainer (1.16) runs its no-grad old-log-prob pass over the rollout (mirrors its condition)."""
        assert self.args.steps_per_generation is not None  # GRPOConfig.__post_init__ fills it
        generate_every = self.args.steps_per_generation * self.num_iterations
        vllm_correction = self.use_vllm and self.vllm_importance_sampling_correction
        return self.args.gradient_accumulation_steps % generate_every != 0 or vllm_correction

    def _generate_and_score_completions(self, inputs):
        if not (self.model.training and self._rollout_flow):
            return super()._generate_and_score_completions(inputs)
        # Capture only TRL's old-log-prob pass: otherwise the first scoring call may be the reference pass (PEFT).
        self._rollout_capture = {} if self._trl_scores_rollout() else None
        try:
            output = super()._generate_and_score_completions(inputs)
            capture = self._rollout_capture or {}
        finally:
            self._rollout_capture = None
        if "scores" in capture:
            old_logps = output.get("old_per_token_logps")
            if old_logps is None or not torch.equal(capture["scores"].logps, old_logps):
                raise RuntimeError(
                    "OPEFOTrainer captured a scoring pass that is not TRL's old-log-prob pass; this TRL version's "
                    "_generate_and_score_completions differs from the supported one."
                )
            output.update(capture["scores"].as_rollout_stats())
        self._rollout_pending = True
        return output

    def _prepare_inputs(self, generation_batch):
        inputs = super()._prepare_inputs(generation_batch)
        if self._rollout_pending:
            # TRL has just shuffled the new rollout batch and split it into the micro-batches it will train on.
            self._rollout_pending = False
            self._prepare_rollout(self._buffered_inputs)
        return inputs

    def _audit_due(self) -> bool:
        every = self.args.entropy_flow_audit_steps
        return every > 0 and (self.state.global_step + 1) % every == 0

    def _prepare_rollout(self, batches: list[dict]) -> None:
        """Factor, flow and (for rollout methods) weights of every micro-batch of a new rollout batch, in place."""
        multimodal = sorted(k for k in MULTIMODAL_KEYS if batches[0].get(k) is not None)
        captured = ROLLOUT_STATS[0] in batches[0]
        if not captured:
            if len(batches) == 1 and self.num_iterations == 1 and self.flow_estimate in TABULAR_ESTIMATES:
                # The rollout batch is one micro-batch scored by the training forward with the same parameters:
                # compute the weights there and save a forward pass.
                self._weights_deferred = True
                return
            if multimodal:
                raise NotImplementedError(
                    f"OPEFOTrainer's own scoring passes are text-only, but this rollout has {multimodal}. Use one "
                    "micro-batch per rollout (gradient_accumulation_steps=1) with a log-prob estimate, or vLLM with "
                    "importance-sampling correction, whose scoring pass TRL runs with the images and OPEFO reuses."
                )
        for batch in batches:
            batch[ADVANTAGES] = _per_token(batch["advantages"], batch["completion_mask"]).float()
        estimator = param_flow = None
        if self.flow_estimate == "param":
            estimator, param_flow = self._estimate_param_flow(batches)
        elif not captured:
            for batch in batches:
                batch.update(self._score(batch, vocab=True).as_rollout_stats())
        token_batches = []
        for i, batch in enumerate(batches):
            logps, entropies = batch[ROLLOUT_STATS[0]], batch[ROLLOUT_STATS[1]]
            if FACTOR not in batch:
                batch[FACTOR] = self._loss_factor(batch, logps, entropies)
            batch[UNIT_FLOW] = flow_per_unit_advantage(
                logps,
                entropies,
                self.flow_estimate,
                batch.get(ROLLOUT_STATS[2]),
                batch.get(ROLLOUT_STATS[3]),
                None if param_flow is None else param_flow.alignment[i],
            )
            token_batches.append(
                TokenBatch(
                    logps=logps,
                    entropies=entropies,
                    advantages=batch[ADVANTAGES],
                    factor=batch[FACTOR],
                    flow=batch[ADVANTAGES] * batch[UNIT_FLOW],
                    old_logps=batch.get("old_per_token_logps"),
                )
            )
        tensors: dict[str, Any] = {
            f.name: torch.cat([getattr(b, f.name) for b in token_batches])
            for f in dataclasses.fields(TokenBatch)
            if isinstance(getattr(token_batches[0], f.name), torch.Tensor)
        }
        whole = TokenBatch(**tensors)
        sizes = [len(b.logps) for b in token_batches]
        if estimator is not None and self.token_method.needs_step_model:
            assert param_flow is not None  # estimated with the estimator
            signs = self.token_method.weight_signs(whole)
            if signs is None:
                raise TypeError(
                    f"{type(self.token_method).__name__}.needs_step_model is True, so its weight_signs(batch) must "
                    "return the s_t of its weights 1 + lambda * s_t, not None."
                )
            signed = [s * c for s, c in zip(signs.split(sizes), param_flow.coefficients, strict=True)]
            whole.step_change = self._identical_on_every_rank(
                estimator.step_model(param_flow, estimator.signed_gradient(batches, signed)).change
            )
        weights = self.token_method.rollout_weights(whole, self._reduce_sum)
        if weights is not None:
            for batch, part in zip(batches, weights.split(sizes), strict=True):
                batch["advantages"] = batch[ADVANTAGES] * part
        for batch in batches:
            for key in ROLLOUT_STATS:
                batch.pop(key, None)
        if param_flow is not None and self._audit_due():  # grad Hbar is kept for the audit of this step
            param_flow.loss_grad = None
            self._param_flow = param_flow

    def _identical_on_every_rank(self, change):
        """The step model's change, averaged over ranks: every rank computes it from the same reduced gradients and
        replicated optimizer state; averaging makes the root search bit-identical on all of them."""
        world = self.accelerator.num_processes
        if world == 1:
            return change

        def averaged(lam: float) -> float:
            value = torch.tensor([change(lam)], dtype=torch.float64, device=self.accelerator.device)
            return float(self._reduce_sum(value)[0]) / world

        return averaged

    # ----------------------------------------------------------------------------------------------------------------
    # The `param` estimate: u_t = <D grad Hbar, grad log pi_t> (opefo_trl.param_flow)
    # ----------------------------------------------------------------------------------------------------------------

    def _estimate_param_flow(self, batches: list[dict]) -> tuple[ParamFlowEstimator, ParamFlow]:
        """The `param` estimator over the rollout's micro-batches, in full precision on the unwrapped model (no DDP
        hooks; gradients are all-reduced by the estimator). Fills each micro-batch's log pi_t, H_t (where TRL did not),
        loss factor and, for the audit, the entropies before the update."""
        estimator = ParamFlowEstimator(
            self._trainable_parameters(),
            self._score_full_precision,
            self._reduce_sum,
            optimizer=self._torch_optimizer(),
            max_grad_norm=self.args.max_grad_norm,
            score_dtype=torch.float32,  # TRL's fused head computes in float32, also for float64 weights
        )

        def coefficients(batch, logps, entropies):  # c_t = f_t A_t of the loss TRL will apply, unweighted
            batch.setdefault(ROLLOUT_STATS[0], logps.float())
            batch.setdefault(ROLLOUT_STATS[1], entropies.float())
            batch[AUDIT_ENTROPIES], batch[AUDIT_FULL_PRECISION] = entropies, True
            batch[FACTOR] = self._loss_factor(batch, batch[ROLLOUT_STATS[0]], batch[ROLLOUT_STATS[1]])
            return batch[FACTOR] * batch[ADVANTAGES]

        flow = estimator.estimate(batches, [self._loss_mask(b).float() for b in batches], coefficients)
        self._log_metrics({"entropy_flow/param_check_error": flow.check_error})
        self._log_metrics({"entropy_flow/param_lambda_error": flow.lambda_error})
        message = warn_imprecise(flow, estimator.relative_steps)
        if message and not self._warned_imprecise and self.accelerator.is_main_process:
            self._warned_imprecise = True
            warnings.warn(message + " (Warned once.)", stacklevel=2)
        return estimator, flow

    # ----------------------------------------------------------------------------------------------------------------
    # Hook 3: every micro-batch
    # ----------------------------------------------------------------------------------------------------------------

    def _compute_loss(self, model, inputs):
        training = self.model.training
        # A copy: the method may replace `advantages`, and TRL reuses buffered micro-batches when num_iterations > 1.
        inputs = dict(inputs)
        self._loss_inputs = inputs if training else None
        self._extra_loss = None
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            self._loss_inputs = None
        if not training:
            return loss
        if self._weights_deferred:
            raise RuntimeError(
                "OPEFOTrainer: the rollout weights were deferred to the training forward but never applied; the loss "
                "did not score completions through _get_per_token_logps_and_entropies (unsupported TRL code path)."
            )
        if self._extra_loss is not None:
            loss = loss + self._aggregate_like_policy_loss(self._extra_loss, self._loss_mask(inputs), inputs)
            self._extra_loss = None
        if self._audit_due():
            self._step_batches.append(inputs)
        if self.accelerator.sync_gradients:
            self._end_optimizer_step()
        return loss

    def _apply_token_method(self, logps: torch.Tensor, entropies: torch.Tensor, vocab) -> None:
        inputs = self._loss_inputs
        assert inputs is not None  # called from the loss forward only
        logps_detached, entropies = logps.detach(), entropies.detach()
        original = inputs.get(ADVANTAGES)
        if original is None:
            original = _per_token(inputs["advantages"], logps_detached).float()
        if UNIT_FLOW in inputs:  # computed for the whole rollout batch
            unit, factor = inputs[UNIT_FLOW], inputs[FACTOR]
        else:
            factor = self._loss_factor(inputs, logps_detached, entropies)
            unit = None
            if self._weights_deferred or (
                self.args.entropy_flow_diagnostics and self.flow_estimate in TABULAR_ESTIMATES
            ):
                unit = flow_per_unit_advantage(logps_detached, entropies, self.flow_estimate, *vocab)
        advantages = _per_token(inputs["advantages"], logps_detached)
        old_logps = inputs.get("old_per_token_logps")
        if self._weights_deferred:
            assert unit is not None  # computed above for the deferred weights
            batch = TokenBatch(logps_detached, entropies, original, factor, original * unit, old_logps)
            weights = self.token_method.rollout_weights(batch, self._reduce_sum)
            if weights is not None:  # None: unweighted, as in _prepare_rollout
                advantages = advantages * weights
            self._weights_deferred = False
        batch = TokenBatch(
            logps_detached, entropies, advantages, factor, None if unit is None else advantages * unit, old_logps
        )
        terms = self.token_method.micro_batch_terms(batch, logps, self._reduce_sum)
        if terms.weights is not None:
            advantages = advantages * terms.weights
        inputs["advantages"] = advantages
        self._extra_loss = terms.extra_loss
        if unit is not None and self.args.entropy_flow_diagnostics:
            stats = flow_stats(original * unit, factor)
            self._step_flow = stats if self._step_flow is None else self._step_flow + stats
        if self._audit_due() and AUDIT_ENTROPIES not in inputs:
            inputs[AUDIT_ENTROPIES], inputs[AUDIT_FULL_PRECISION] = entropies, False

    def _end_optimizer_step(self) -> None:
        """After the last micro-batch of an optimizer step: controllers, then step-level metrics (all ranks)."""
        self.token_method.on_optimizer_step(self._reduce_sum)
        self._log_metrics(self.token_method.pop_metrics())
        if self._step_flow is not None:
            self._log_metrics(FlowStats.from_tensor(self._reduce_sum(self._step_flow.to_tensor())).metrics())
            self._step_flow = None
        message = self.token_method.regime_warning()
        if message and self.accelerator.is_main_process:
            warnings.warn(message, stacklevel=2)

    # ----------------------------------------------------------------------------------------------------------------
    # Hook 4: around the optimizer step, measure what it did
    # ----------------------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def _before_optimizer_step(self) -> None:
        """`param`, audited step: the first-order change predicted from the real (clipped) gradient and the optimizer's
        state before the step, and <grad Hbar, theta> to difference after it."""
        if self._param_flow is None or not self._audit_due():
            return
        params, entropy_grad = self._trainable_parameters(), self._param_flow.entropy_grad
        self._audit_before = {
            "entropy_flow/predicted_delta": first_order_change(
                self._torch_optimizer(), params, entropy_grad, (p.grad for p in params)
            ),
            "parameter_projection": inner(entropy_grad, params),
        }

    @torch.no_grad()
    def _audit_optimizer_step(self) -> None:
        """Log the measured change of the step's mean token entropy: each micro-batch re-scored after the update in the
        precision of its first scoring, per-token differences summed in float64; with `param`, the predicted change and
        <grad Hbar, theta_after - theta_before> (the first-order change of the real parameter change)."""
        if not self._audit_due() or not self._step_batches:
            self._param_flow, self._step_batches = None, []
            return
        sums = torch.zeros(2, dtype=torch.float64, device=self.accelerator.device)
        for batch in self._step_batches:
            after = self._score(batch, full_precision=batch[AUDIT_FULL_PRECISION]).entropies
            mask = self._loss_mask(batch).double()
            sums += torch.stack([((after.double() - batch[AUDIT_ENTROPIES].double()) * mask).sum(), mask.sum()])
        sums = self._reduce_sum(sums)
        metrics = {"entropy_flow/measured_delta": float(sums[0] / sums[1].clamp(min=1))}
        if self._audit_before:
            assert self._param_flow is not None  # _before_optimizer_step filled _audit_before from it
            params = self._trainable_parameters()
            projection = inner(self._param_flow.entropy_grad, params)
            metrics["entropy_flow/predicted_delta"] = self._audit_before["entropy_flow/predicted_delta"]
            metrics["entropy_flow/step_first_order"] = projection - self._audit_before["parameter_projection"]
        self._log_metrics(metrics)
        self._param_flow, self._step_batches, self._audit_before = None, [], {}

    # ----------------------------------------------------------------------------------------------------------------
    # Checkpoints: method state (e.g. PAR's coefficient) travels with the optimizer state
    # ----------------------------------------------------------------------------------------------------------------

    def create_optimizer(self, *args, **kwargs):
        optimizer = super().create_optimizer(*args, **kwargs)
        if self.flow_estimate == "param" and self._rollout_flow:
            check_optimizer(getattr(optimizer, "optimizer", optimizer), self.args.entropy_flow_preconditioner)
        return optimizer

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            folder = os.path.join(
                self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            )
            with open(os.path.join(folder, METHOD_STATE_NAME), "w") as f:
                json.dump({"method": self.args.method, "state": self.token_method.state_dict()}, f)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        path = None if checkpoint is None else os.path.join(checkpoint, METHOD_STATE_NAME)
        if path is None or not os.path.exists(path):
            return
        with open(path) as f:
            saved = json.load(f)
        if saved["method"] != self.args.method:
            raise ValueError(
                f"Checkpoint {checkpoint} was trained with method={saved['method']!r}, but this run uses "
                f"method={self.args.method!r}. Resume with the same method, or start from the weights without "
                "resume_from_checkpoint."
            )
        self.token_method.load_state_dict(saved["state"])

    # ----------------------------------------------------------------------------------------------------------------
    # Run-time input checks and the data order of resumed runs (opefo_trl.checks, opefo_trl.runs)
    # ----------------------------------------------------------------------------------------------------------------

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's reward computation with every reward function's output checked (`opefo_trl.checks.RewardCheck`):
        an exception, a non-number or an infinite reward is raised naming the function, on every process."""
        check = RewardCheck(num_completions=len(prompts))
        funcs = self.reward_funcs
        self.reward_funcs = check.wrap(funcs, self.reward_func_names, is_async=is_async_callable)
        try:
            rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        finally:
            self.reward_funcs = funcs
        failed = torch.tensor(float(check.error is not None), device=rewards.device)
        check.raise_if_failed(int(self._reduce_sum(failed)))
        return rewards

    def _get_train_sampler(self, dataset=None):
        """TRL's sampler, drawing each epoch's order from the seed and the epoch (`opefo_trl.runs.EpochSeededSampler`),
        so a resumed run draws what an uninterrupted one does."""
        return EpochSeededSampler(super()._get_train_sampler(dataset))
