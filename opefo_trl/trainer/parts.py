"""How `OPEFOTrainer`'s parts are built: what each is given, read from the trainer (`TrainerAccess`), and which parts
a configuration needs (`build_parts`).

This module, and `opefo_trl.experimental.extension_parts` for the library's extensions (the `param` estimate, its
fixed probe and the entropy audit), are the only ones that read the trainer's attributes (its accelerator, arguments,
state and TRL's own helpers); the parts themselves take plain callables and values in their constructors.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from accelerate.utils import reduce
from trl import GRPOTrainer

from opefo_trl.experimental import extension_parts
from opefo_trl.experimental.entropy_audit import EntropyAudit
from opefo_trl.experimental.param_estimate import ParamEstimate
from opefo_trl.experimental.task_tokens import task_token_ids
from opefo_trl.maths.entropy_flow import BIASED_ESTIMATES, TABULAR_ESTIMATES
from opefo_trl.maths.lm_head import core_model
from opefo_trl.maths.ranks import ReduceSum
from opefo_trl.methods import TokenMethod
from opefo_trl.trainer import model_setup
from opefo_trl.trainer.checks import RewardCheck
from opefo_trl.trainer.config import needs_moments, uses_loss_factor
from opefo_trl.trainer.generation_stats import GenerationStats
from opefo_trl.trainer.loss_mirror import LossMirror, trl_scores_rollout
from opefo_trl.trainer.scoring import Scorer
from opefo_trl.trainer.token_weights import MicroBatchWeigher, RolloutWeigher


class TrainerAccess:
    """What the parts are given: the trainer's rank reducer, metrics sink, model and optimizer accessors, each read
    when called (accelerate wraps the model and creates the optimizer after the parts are built)."""

    def __init__(self, trainer: Any):
        self.trainer = trainer
        #: Sums a tensor over ranks: accelerate's reduction itself, which ``Accelerator.reduce`` calls.
        self.reduce_sum: ReduceSum = partial(reduce, reduction="sum")

    def log_metrics(self, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.trainer._metrics["train"][name].append(value)

    def core_model(self) -> Any:
        """The causal LM carrying the fused head (unwrapped from DDP/DeepSpeed and PEFT)."""
        return core_model(self.trainer.accelerator.unwrap_model(self.trainer.model))

    def trainable_parameters(self) -> list[torch.Tensor]:
        return [p for p in self.trainer.accelerator.unwrap_model(self.trainer.model).parameters() if p.requires_grad]

    def torch_optimizer(self) -> Any:
        optimizer = self.trainer.optimizer
        return getattr(optimizer, "optimizer", optimizer)  # inside accelerate's AcceleratedOptimizer

    def device(self) -> torch.device:
        return self.trainer.accelerator.device


@dataclass
class Parts:
    """The parts of one `OPEFOTrainer` (None where its configuration needs none)."""

    access: TrainerAccess
    loss_mirror: LossMirror
    scorer: Scorer
    audit: EntropyAudit
    param_estimate: ParamEstimate | None
    rollout: RolloutWeigher | None
    micro_batches: MicroBatchWeigher
    reward_check: RewardCheck
    #: Where the rollout's log pi_t and H_t (lambda*'s inputs) come from (:func:`scores_source`), None without a
    #: rollout pass.
    scores_source: str | None = None


def build_parts(trainer: Any, probe_prompts: Any = None) -> Parts:
    """The parts a built `OPEFOTrainer` hands over to, for its configuration (``probe_prompts``: the fixed probe's
    prompts, or None)."""
    args, estimate, method = trainer.args, trainer.args.entropy_flow_estimate, trainer.token_method
    access = TrainerAccess(trainer)
    # The flow of the whole rollout batch is needed before the first backward.
    rollout_flow = method.needs_rollout_pass or (args.entropy_flow_diagnostics and estimate == "param")
    model_setup.refuse_unsupported_setup(
        args,
        computes_flow=rollout_flow or args.entropy_flow_diagnostics,
        rollout_param=rollout_flow and estimate == "param",
        trainable=access.trainable_parameters(),
        deepspeed=trainer.is_deepspeed_enabled,
        fsdp=trainer.is_fsdp_enabled,
        main_process=trainer.accelerator.is_main_process,
        attention=access.core_model().config._attn_implementation,
    )
    loss_mirror = LossMirror.of(trainer)
    if method.balances_the_step and loss_mirror.nonlinear_terms:
        raise ValueError(
            f"opefo_balance='step' balances the gradient the rollout pass writes, a + lambda b, but TRL's training "
            f"pass would also apply {'; '.join(loss_mirror.nonlinear_terms)}, which move the entropy "
            "outside the balance. Remove them (the paper's setup has none), or use opefo_balance='batch'."
        )
    vocab_size = access.core_model().config.get_text_config().vocab_size
    task_tokens = task_token_ids(args, vocab_size, next(trainer.model.parameters()).device)
    checkpointing = args.gradient_checkpointing_kwargs
    assert not isinstance(checkpointing, str)  # TrainingArguments.__post_init__ parses a JSON string into a dict
    scorer = Scorer(
        model=lambda: trainer.model,
        unwrap=trainer.accelerator.unwrap_model,
        trl_score=partial(GRPOTrainer._get_per_token_logps_and_entropies, trainer),
        autocast=trainer.accelerator.autocast,
        temperature=trainer.temperature,
        head_in_float32=args.cast_lm_head_to_fp32,
        batch_size=args.per_device_train_batch_size,
        checkpointing_kwargs=checkpointing,
        token_chunk_size=args.vocab_stats_token_chunk_size,
        vocab_chunk_size=args.vocab_stats_vocab_chunk_size,
        entropy_tokens=task_tokens if args.entropy_flow_entropy == "task_tokens" else None,
    )
    audit = extension_parts.build_audit(trainer, access, scorer, loss_mirror)
    param_estimate = None
    if rollout_flow and estimate == "param":
        param_estimate = extension_parts.build_param_estimate(trainer, access, scorer, loss_mirror, probe_prompts)
    trl_scores = trl_scores_rollout(
        args, use_vllm=trainer.use_vllm, importance_sampling_correction=trainer.vllm_importance_sampling_correction
    )
    # Without TRL's pass, a rollout of several micro-batches takes log pi and H from generation's logits.
    reads_generation = not (trl_scores or trainer.use_vllm) and estimate in TABULAR_ESTIMATES
    reads_generation = reads_generation and loss_mirror.steps_per_generation > 1
    rollout = None
    writes_gradient = loss_mirror.gradient_is_linear and type(method).micro_batch_terms is TokenMethod.micro_batch_terms
    if method.balances_the_step and not writes_gradient and trainer.accelerator.is_main_process:
        warnings.warn(
            f"{type(method).__name__} adds micro-batch terms to TRL's loss, so TRL's training pass is run instead of "
            "writing the rollout's gradient, and the step balance does not include those terms.",
            stacklevel=3,
        )
    moments = needs_moments(args)
    bias = args.entropy_flow_bias_diagnostics and estimate in BIASED_ESTIMATES
    if rollout_flow:
        rollout = RolloutWeigher(
            method,
            estimate,
            moments,
            bias,
            loss_mirror,
            scorer,
            param_estimate,
            audit,
            access.reduce_sum,
            num_iterations=trainer.num_iterations,
            trl_scores_rollout=trl_scores,
            writes_gradient=writes_gradient,
            generation=GenerationStats(trainer.temperature, moments) if reads_generation else None,
        )
    micro_batches = MicroBatchWeigher(
        method,
        estimate,
        moments,
        bias,
        args.entropy_flow_diagnostics,
        rollout_flow,
        loss_mirror,
        scorer,
        access.reduce_sum,
        access.log_metrics,
        trainer.accelerator.is_main_process,
        access.trainable_parameters,
        task_tokens=task_tokens,
        check_mirror=uses_loss_factor(args, type(method)),
    )
    source = None
    if rollout is not None:
        source = scores_source(estimate, trl_scores, reads_generation, rollout.defers_to_training_forward)
    return Parts(access, loss_mirror, scorer, audit, param_estimate, rollout, micro_batches, RewardCheck(), source)


def scores_source(estimate: str, trl_scores: bool, reads_generation: bool, in_training_forward: bool) -> str:
    """Where the rollout pass takes log pi_t and H_t from, in the order `RolloutWeigher` tries them.

    Example:
        >>> scores_source("opefo", trl_scores=True, reads_generation=False, in_training_forward=False)
        "TRL's own no-grad old-log-prob pass over the rollout (reused, no extra forward)"
    """
    if estimate == "param":
        return "the `param` estimate's own gradient passes over each micro-batch"
    if trl_scores:
        return "TRL's own no-grad old-log-prob pass over the rollout (reused, no extra forward)"
    if reads_generation:
        return "generation's logits (read while TRL samples, no extra forward)"
    if in_training_forward:
        return "the training forward (one micro-batch per rollout, no extra forward)"
    return "a no-grad scoring pass of the trainer's over each micro-batch (one extra forward per micro-batch)"
