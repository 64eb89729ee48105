"""`OPEFOTrainer`: TRL's `GRPOTrainer` with a pluggable token-level method (OPEFO by default).

Where the algorithm touches TRL, and why there (the least copied TRL code for the exact algorithm):

1. `_generate_and_score_completions` (once per rollout batch, whole local batch): for methods that need
   statistics of the whole rollout batch before the first backward (OPEFO's lambda*), compute log pi_t and H_t of
   the current policy, let the method turn them into detached fp32 token weights (its sums all-reduced over ranks),
   and store `advantages * weights` as (B, T) advantages. TRL accepts (B, T) advantages everywhere, and since the
   weights are >= 0 this is exactly the reweighted loss for every loss type, clipping, KL, entropy bonus, vLLM
   importance correction, normalisation and metrics included. The statistics come from, in order of preference:
   TRL's own no-grad scoring pass when it runs one (vLLM correction, off-policy), hooked to also return entropies
   (no extra forward); the training forward itself when the rollout batch is a single micro-batch (no extra
   forward); else one no-grad forward of ours.
2. `_get_per_token_logps_and_entropies` (every forward that scores completions): captures those statistics, and,
   for the `full` estimate, the final hidden states, from which a chunked pass over the (ZeRO-3 gathered) LM head
   computes sum pi^2 and sum pi^2 log pi without materialising [tokens, vocab] logits.
3. `_compute_loss` (every micro-batch): calls TRL's own loss on a copy of the inputs whose advantages the method
   may weight (PAR, Clip-Cov) from the current log-probs, adds the method's extra per-token loss (KL-Cov) aggregated
   like TRL's policy loss, accumulates the entropy-flow diagnostics, and at the optimizer-step boundary updates
   method controllers (PAR) and logs. TRL's `_compute_loss` is called, never copied, so its metrics keep flowing.

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
import json
import os
from contextlib import contextmanager

import torch

from ._compat import check_trl_version

check_trl_version()

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.models.utils import disable_gradient_checkpointing  # noqa: E402
from trl.trainer.utils import maybe_gather_lm_head_ctx  # noqa: E402

from .config import OPEFOConfig  # noqa: E402
from .entropy_flow import FlowStats, flow_stats  # noqa: E402
from .methods import TokenBatch, TokenMethod, get_token_method_class  # noqa: E402
from .vocab_stats import vocab_stats  # noqa: E402

METHOD_STATE_NAME = "opefo_method_state.json"


def _logit_scale(text_config) -> float:
    """The multiplier TRL's fused head applies to the logits (same lookup as `trl.trainer.utils.add_fused_lm_head`)."""
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        if getattr(text_config, name, None) is not None:
            return getattr(text_config, name)
    if getattr(text_config, "logits_scaling", None) is not None:
        scaling = text_config.logits_scaling
        return scaling if text_config.model_type == "hyperclovax" else 1 / scaling
    return 1.0


def _as_opefo_config(args: GRPOConfig | None, model) -> OPEFOConfig:
    """Accept a plain GRPOConfig (drop-in use): same settings, OPEFO's defaults for the new fields."""
    if args is None:
        name = model if isinstance(model, str) else model.config._name_or_path
        return OPEFOConfig(output_dir=f"{name.split('/')[-1]}-OPEFO")
    if isinstance(args, OPEFOConfig):
        return args
    if not isinstance(args, GRPOConfig):
        raise TypeError(f"OPEFOTrainer expects an OPEFOConfig (or a GRPOConfig), got {type(args).__name__}.")
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(GRPOConfig) if f.init}
    # GRPOConfig derives generation_batch_size from steps_per_generation and refuses both set: re-derive it.
    values["generation_batch_size"] = None
    return OPEFOConfig(**values)


class OPEFOTrainer(GRPOTrainer):
    """A drop-in [`~trl.GRPOTrainer`] whose per-token policy-gradient terms are weighted by a token method.

    Takes exactly `GRPOTrainer`'s arguments. `args` is an [`OPEFOConfig`] (a `GRPOConfig` is converted, with
    `method="opefo"`). Logged on top of TRL's metrics: `entropy_flow/{lambda,increase,decrease,net,
    increase_token_frac,decrease_token_frac}` (reduced over ranks) and each method's own (`opefo/*`, `par/*`,
    `clip_cov/*`, `kl_cov/*`).
    """

    _tag_names = ["trl", "grpo", "opefo"]
    _name = "OPEFO"

    def __init__(self, model, reward_funcs, args: OPEFOConfig | GRPOConfig | None = None, *pargs, **kwargs):
        args = _as_opefo_config(args, model)
        self.token_method: TokenMethod = get_token_method_class(args.method).from_args(args)
        # Per-call state of the hooks below (None when inactive).
        self._rollout_capture: dict | None = None  # statistics of the rollout batch being scored
        self._loss_inputs: dict | None = None  # the micro-batch whose loss is being computed
        self._extra_loss: torch.Tensor | None = None
        self._weights_deferred = False  # rollout weights to be computed from the (single) training micro-batch
        self._diagnostics: FlowStats | None = None  # entropy flow accumulated over the optimizer step
        self._hidden_chunks: list[torch.Tensor] | None = None
        self._hidden_hook = None
        super().__init__(model, reward_funcs, args, *pargs, **kwargs)

    # ----------------------------------------------------------------------------------------------------------------
    # Small helpers
    # ----------------------------------------------------------------------------------------------------------------

    def _reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(tensor, reduction="sum")

    def _log_metrics(self, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self._metrics["train"][name].append(value)

    def _in_diagnostics(self) -> bool:
        """Diagnostics come from the rollout pass for rollout methods, from the training forward otherwise."""
        return self.args.entropy_flow_diagnostics and not self.token_method.needs_rollout_pass

    def _needs_vocab_stats(self, in_loss: bool) -> bool:
        if in_loss:
            return (self._weights_deferred and self.token_method.needs_vocab_stats) or (
                self._in_diagnostics() and self.args.entropy_flow_estimate == "full"
            )
        return self.token_method.needs_vocab_stats

    def _core_model(self):
        """The causal LM carrying the fused head (unwrapped from DDP/DeepSpeed and PEFT)."""
        core = self.accelerator.unwrap_model(self.model)
        return core.get_base_model() if hasattr(core, "get_base_model") else core

    @contextmanager
    def _capture_hidden_states(self, enabled: bool):
        """Collect the backbone's final hidden states of every forward inside the block (no second backbone pass)."""
        if not enabled:
            yield None
            return
        if self._hidden_hook is None:

            def keep(module, args, output):
                if self._hidden_chunks is not None:
                    hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
                    self._hidden_chunks.append(hidden.detach())

            self._hidden_hook = self._core_model().base_model.register_forward_hook(keep)
        self._hidden_chunks = chunks = []
        try:
            yield chunks
        finally:
            self._hidden_chunks = None

    @torch.no_grad()
    def _completion_vocab_stats(self, hidden: torch.Tensor, logits_to_keep: int):
        """sum pi^2 and sum pi^2 log pi at the completion positions, (B, T), from hidden states and the LM head."""
        core = self._core_model()
        text_config = core.config.get_text_config()
        head = core.get_output_embeddings()
        # Position i predicts token i + 1: the completion's T tokens are predicted from hidden[-T-1:-1].
        hidden = hidden[:, -logits_to_keep - 1 : -1]
        with maybe_gather_lm_head_ctx(head.weight, head.bias):
            stats = vocab_stats(
                hidden,
                head.weight,
                head.bias,
                temperature=self.temperature,
                logit_scale=_logit_scale(text_config),
                softcap=getattr(text_config, "final_logit_softcapping", None),
                token_chunk_size=self.args.vocab_stats_token_chunk_size,
                vocab_chunk_size=self.args.vocab_stats_vocab_chunk_size,
            )
        return stats.sum_sq_probs, stats.sum_sq_probs_log_probs

    @staticmethod
    def _loss_mask(batch: dict) -> torch.Tensor:
        mask = batch["completion_mask"]
        return mask * batch["tool_mask"] if "tool_mask" in batch else mask

    # ----------------------------------------------------------------------------------------------------------------
    # Hook 2: every scoring forward
    # ----------------------------------------------------------------------------------------------------------------

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, **kwargs
    ):
        # The first scoring call of a rollout on the policy itself is TRL's old-log-prob pass (the reference pass,
        # when there is one, comes after it): take its statistics instead of running a pass of our own.
        capture = (
            self._rollout_capture is not None and "logps" not in self._rollout_capture and model is not self.ref_model
        )
        in_loss = self._loss_inputs is not None  # the loss scores only the policy (possibly DDP/DeepSpeed-wrapped)
        with self._capture_hidden_states(
            (capture and self._needs_vocab_stats(False)) or (in_loss and self._needs_vocab_stats(True))
        ) as hidden_chunks:
            logps, entropies, aux_loss = super()._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size=batch_size,
                compute_entropy=compute_entropy or capture,
                **kwargs,
            )
        vocab = (None, None)
        if hidden_chunks:
            vocab = self._completion_vocab_stats(torch.cat(hidden_chunks), logits_to_keep)
        if capture:
            self._rollout_capture.update(logps=logps.detach(), entropies=entropies.detach(), vocab=vocab)
        if in_loss:
            self._apply_token_method(logps, entropies, vocab)
        return logps, entropies, aux_loss

    # ----------------------------------------------------------------------------------------------------------------
    # Hook 1: once per rollout batch
    # ----------------------------------------------------------------------------------------------------------------

    def _trl_scores_rollout(self) -> bool:
        """Whether GRPOTrainer (1.16) runs its no-grad old-log-prob pass over the rollout (mirrors its condition)."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        vllm_correction = self.use_vllm and self.vllm_importance_sampling_correction
        return self.args.gradient_accumulation_steps % generate_every != 0 or vllm_correction

    def _generate_and_score_completions(self, inputs):
        if not (self.model.training and self.token_method.needs_rollout_pass):
            return super()._generate_and_score_completions(inputs)
        # Capture only TRL's old-log-prob pass: otherwise the first scoring call may be the reference pass (PEFT).
        self._rollout_capture = {} if self._trl_scores_rollout() else None
        try:
            output = super()._generate_and_score_completions(inputs)
            capture = self._rollout_capture or {}
        finally:
            self._rollout_capture = None
        old_logps = output.get("old_per_token_logps")
        if "logps" in capture and (old_logps is None or not torch.equal(capture["logps"], old_logps)):
            raise RuntimeError(
                "OPEFOTrainer captured a scoring pass that is not TRL's old-log-prob pass; this TRL version's "
                "_generate_and_score_completions differs from the supported one."
            )
        self._weights_deferred = False
        if "logps" not in capture:
            # (With num_iterations > 1 the buffered batch is reused: its weights must be in it, so no deferral.)
            if self.args.steps_per_generation == 1 and self.num_iterations == 1:
                # The rollout batch is one micro-batch scored by the training forward with the same parameters:
                # compute the weights there and save a forward pass.
                self._weights_deferred = True
                return output
            capture = self._score_rollout(output)
        batch = TokenBatch(
            logps=capture["logps"],
            entropies=capture["entropies"],
            advantages=output["advantages"].unsqueeze(1).expand_as(capture["logps"]),
            mask=self._loss_mask(output),
            old_logps=output.get("old_per_token_logps"),
            sum_sq_probs=capture["vocab"][0],
            sum_sq_probs_log_probs=capture["vocab"][1],
        )
        weights = self.token_method.rollout_weights(batch, self._reduce_sum)
        self._log_metrics(self.token_method.pop_metrics())
        output["advantages"] = batch.advantages * weights
        return output

    def _score_rollout(self, output: dict) -> dict:
        """One no-grad forward of the current policy over the local rollout batch (text-only)."""
        multimodal = sorted(
            k for k in ("pixel_values", "image_grid_thw", "num_images", "token_type_ids") if k in output
        )
        if multimodal:
            raise NotImplementedError(
                f"OPEFOTrainer's own scoring pass is text-only, but this rollout has {multimodal}. Use one micro-batch "
                "per rollout (gradient_accumulation_steps=1) or vLLM with importance-sampling correction, whose "
                "scoring pass TRL runs with the images and OPEFO reuses."
            )
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        self._rollout_capture = {}
        try:
            with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
                self._get_per_token_logps_and_entropies(
                    self.model,
                    input_ids,
                    attention_mask,
                    output["completion_ids"].size(1),
                    batch_size=self.args.per_device_train_batch_size,
                    compute_entropy=True,
                )
            return self._rollout_capture
        finally:
            self._rollout_capture = None

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
        if self._weights_deferred and training:
            raise RuntimeError(
                "OPEFOTrainer: the rollout weights were deferred to the training forward but never applied; the loss "
                "did not score completions through _get_per_token_logps_and_entropies (unsupported TRL code path)."
            )
        if self._extra_loss is not None:
            loss = loss + self._aggregate_like_policy_loss(self._extra_loss, self._loss_mask(inputs), inputs)
            self._extra_loss = None
        if training and self.accelerator.sync_gradients:
            self._end_optimizer_step()
        return loss

    def _apply_token_method(self, logps: torch.Tensor, entropies: torch.Tensor, vocab) -> None:
        inputs = self._loss_inputs
        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1).expand_as(logps)
        batch = TokenBatch(
            logps=logps.detach(),
            entropies=entropies.detach(),
            advantages=advantages,
            mask=self._loss_mask(inputs),
            old_logps=inputs.get("old_per_token_logps"),
            sum_sq_probs=vocab[0],
            sum_sq_probs_log_probs=vocab[1],
        )
        if self._weights_deferred:
            advantages = advantages * self.token_method.rollout_weights(batch, self._reduce_sum)
            self._weights_deferred = False
        if self._in_diagnostics():
            step = flow_stats(batch.flow(self.args.entropy_flow_estimate), batch.mask)
            self._diagnostics = step if self._diagnostics is None else self._diagnostics + step
        terms = self.token_method.micro_batch_terms(batch, logps, self._reduce_sum)
        if terms.weights is not None:
            advantages = advantages * terms.weights
        inputs["advantages"] = advantages
        self._extra_loss = terms.extra_loss
        self._log_metrics(self.token_method.pop_metrics())

    def _aggregate_like_policy_loss(self, per_token: torch.Tensor, mask: torch.Tensor, inputs: dict) -> torch.Tensor:
        """Reduce a per-token loss term exactly as TRL reduces the policy loss for the configured loss type."""
        accumulation = self.current_gradient_accumulation_steps
        masked = per_token * mask
        if self.loss_type in ("grpo", "sapo"):
            return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation
        if self.loss_type == "bnpo":
            return masked.sum() / mask.sum().clamp(min=1.0) / accumulation
        if self.loss_type == "dr_grpo":
            return masked.sum() / (per_token.size(0) * self.max_completion_length) / accumulation
        if self.loss_type in ("cispo", "dapo", "vespo"):
            normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            return masked.sum() / (normalizer * accumulation / self.args.steps_per_generation)
        if self.loss_type == "luspo":
            return masked.sum(-1).mean() / accumulation
        raise ValueError(f"Loss type {self.loss_type!r} is not supported together with method={self.args.method!r}.")

    def _end_optimizer_step(self) -> None:
        """After the last micro-batch of an optimizer step: controllers, then step-level metrics (all ranks)."""
        self.token_method.on_optimizer_step(self._reduce_sum)
        self._log_metrics(self.token_method.pop_metrics())
        if self._diagnostics is not None:
            stats = FlowStats.from_tensor(self._reduce_sum(self._diagnostics.to_tensor()))
            self._log_metrics(stats.metrics())
            self._diagnostics = None

    # ----------------------------------------------------------------------------------------------------------------
    # Checkpoints: method state (e.g. PAR's coefficient) travels with the optimizer state
    # ----------------------------------------------------------------------------------------------------------------

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
