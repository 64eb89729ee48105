"""`OPEFOTrainer`: TRL's `GRPOTrainer` with a pluggable token-level method (OPEFO by default).

The trainer holds only `__init__` and TRL's hooks; each hook hands over to a part of this package:

- `_generate_and_score_completions`, `_prepare_inputs` (once per rollout batch): `rollout.RolloutWeigher`, with
  `param_estimate.ParamEstimate` for the `param` estimate;
- `_compute_loss` (every micro-batch): `micro_batch.MicroBatchWeigher`, with `loss_mirror.LossMirror` (TRL's per-token
  factor and loss aggregation);
- `_get_per_token_logps_and_entropies` (every TRL scoring call): the observer of the call in progress, if any (TRL's
  old-log-prob pass over a new rollout: a `rollout.RolloutCapture`; the loss forward: a `micro_batch.LossCall`);
- around the optimizer step (callbacks): `audit.EntropyAudit`;
- `create_optimizer`: `ParamEstimate.check_optimizer`; `train` (resume from the last *whole* checkpoint),
  `_save_checkpoint` (whole or removed), `_load_optimizer_and_scheduler` (the method's state): `opefo_trl.runs`;
  `_calculate_rewards`: `checks.RewardCheck`; `_get_train_sampler`: `sampler.EpochSeededSampler`.

The trainer's own forwards go through `scoring.Scorer`; the policy's precision set-up is `model_setup`. The TRL code
each part relies on, and what to check on a TRL upgrade: CONTRIBUTING.md ("Support a new TRL version").

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

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch

from opefo_trl._compat import check_trl_version

check_trl_version()

from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.trainer.utils import get_config_model_id  # noqa: E402

from opefo_trl.maths.entropy_flow import TABULAR_ESTIMATES  # noqa: E402
from opefo_trl.methods import TokenMethod, get_token_method_class  # noqa: E402
from opefo_trl.runs import load_method_state, resume_checkpoint, saving_checkpoint  # noqa: E402
from opefo_trl.trainer import model_setup  # noqa: E402
from opefo_trl.trainer.audit import EntropyAudit  # noqa: E402
from opefo_trl.trainer.checks import RewardCheck, check_training_values  # noqa: E402
from opefo_trl.trainer.config import OPEFOConfig, with_opefo_settings  # noqa: E402
from opefo_trl.trainer.generation_stats import GenerationStats  # noqa: E402
from opefo_trl.trainer.loss_mirror import LossMirror, trl_scores_rollout  # noqa: E402
from opefo_trl.trainer.micro_batch import MicroBatchWeigher  # noqa: E402
from opefo_trl.trainer.param_estimate import ParamEstimate  # noqa: E402
from opefo_trl.trainer.probe import FixedProbe, check_probe_dataset  # noqa: E402
from opefo_trl.trainer.rollout import RolloutWeigher  # noqa: E402
from opefo_trl.trainer.sampler import EpochSeededSampler  # noqa: E402
from opefo_trl.trainer.scoring import Scorer, ScoringObserver, core_model  # noqa: E402


class OPEFOTrainer(GRPOTrainer):
    """A drop-in [`~trl.GRPOTrainer`] whose per-token policy-gradient terms are weighted by a token method.

    Takes exactly `GRPOTrainer`'s arguments (`reward_funcs` optional with an `environment_factory` that owns the
    reward; `args=None`: `GRPOConfig`'s defaults in `<model>-GRPO`, as `GRPOTrainer` names it), and `probe_dataset`: a
    data set of prompts (a `prompt` column, as `train_dataset`) never trained on, whose completions, sampled once at
    the start, the `param` flow measures the entropy of too (`opefo_trl.trainer.probe`). `args` is an
    [`OPEFOConfig`], or a `GRPOConfig` (or subclass), which is kept as it is (same object, class and fields) and given
    the OPEFO options with their defaults (`method="opefo"`). What reward functions return is checked on every call
    (`opefo_trl.trainer.checks`), and each epoch's data order follows from the seed and the epoch
    (`opefo_trl.trainer.sampler`). Logged on top of TRL's metrics: `entropy_flow/{lambda,increase,decrease,net,
    increase_token_frac,decrease_token_frac}` (with `entropy_flow_diagnostics`), `entropy_flow/measured_delta` (with
    `entropy_flow_audit_steps`; with `param` also `entropy_flow/{predicted_delta,step_first_order}`),
    `entropy_flow/{param_check_error,param_lambda_error}` (`param` estimate), and each method's own metrics (e.g.
    `opefo/*`, `par/*`); all reduced over ranks.
    """

    _tag_names = ["trl", "grpo", "opefo"]
    _name = "OPEFO"
    #: An `OPEFOConfig`, or a `GRPOConfig` given every OPEFO option by `with_opefo_settings`.
    args: OPEFOConfig

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: OPEFOConfig | GRPOConfig | None = None,
        *pargs,
        probe_dataset=None,
        **kwargs,
    ):
        if args is None:  # the output_dir GRPOTrainer (TRL 1.16) defaults to, so that swapping the class moves nothing
            name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = OPEFOConfig(output_dir=f"{name.split('/')[-1]}-GRPO")
        args = with_opefo_settings(args)
        check_training_values(args)
        self.token_method: TokenMethod = get_token_method_class(args.method).from_config(args)
        self._probe_prompts = check_probe_dataset(probe_dataset, args, self.token_method.needs_rollout_pass)
        self._observer: ScoringObserver | None = None  # TRL's scoring call in progress that a part observes
        model_setup.keep_float64_head(model, args)
        cast_peft_head = model_setup.casts_peft_head(model, args, (reward_funcs, args, *pargs), kwargs)
        with model_setup.trl_builds_without_head_cast(args, cast_peft_head):
            super().__init__(model, reward_funcs, args, *pargs, **kwargs)
        if cast_peft_head:
            model_setup.cast_peft_lm_head_to_fp32(self._core_model(), self.temperature)
        self._build_parts()

    def _build_parts(self) -> None:
        args, estimate = self.args, self.args.entropy_flow_estimate
        # The flow of the whole rollout batch is needed before the first backward.
        rollout_flow = self.token_method.needs_rollout_pass or (args.entropy_flow_diagnostics and estimate == "param")
        model_setup.refuse_unsupported_setup(
            args,
            computes_flow=rollout_flow or args.entropy_flow_diagnostics,
            rollout_param=rollout_flow and estimate == "param",
            trainable=self._trainable_parameters(),
            deepspeed=self.is_deepspeed_enabled,
            fsdp=self.is_fsdp_enabled,
            main_process=self.accelerator.is_main_process,
            attention=self._core_model().config._attn_implementation,
        )
        main_process = self.accelerator.is_main_process
        self.loss_mirror = LossMirror.of(self)
        checkpointing = args.gradient_checkpointing_kwargs
        assert not isinstance(checkpointing, str)  # TrainingArguments.__post_init__ parses a JSON string into a dict
        self.scorer = Scorer(
            model=lambda: self.model,
            unwrap=self.accelerator.unwrap_model,
            trl_score=partial(GRPOTrainer._get_per_token_logps_and_entropies, self),
            autocast=self.accelerator.autocast,
            temperature=self.temperature,
            head_in_float32=args.cast_lm_head_to_fp32,
            batch_size=args.per_device_train_batch_size,
            checkpointing_kwargs=checkpointing,
            token_chunk_size=args.vocab_stats_token_chunk_size,
            vocab_chunk_size=args.vocab_stats_vocab_chunk_size,
        )
        self.audit = EntropyAudit(
            every=args.entropy_flow_audit_steps,
            global_step=lambda: self.state.global_step,
            score=self.scorer.score,
            score_full_precision=self.scorer.score_full_precision,
            loss_mask=self.loss_mirror.mask,
            reduce_sum=self._reduce_sum,
            device=lambda: self.accelerator.device,
            log_metrics=self._log_metrics,
            params=self._trainable_parameters,
            optimizer=self._torch_optimizer,
        )
        self.param_estimate = self._param_estimate() if rollout_flow and estimate == "param" else None
        trl_scores = trl_scores_rollout(
            args, use_vllm=self.use_vllm, importance_sampling_correction=self.vllm_importance_sampling_correction
        )
        # Without TRL's pass, a rollout of several micro-batches takes log pi and H from generation's logits.
        reads_generation = not (trl_scores or self.use_vllm) and estimate in TABULAR_ESTIMATES
        reads_generation = reads_generation and self.loss_mirror.steps_per_generation > 1
        self.rollout = (
            RolloutWeigher(
                self.token_method,
                estimate,
                self.loss_mirror,
                self.scorer,
                self.param_estimate,
                self.audit,
                self._reduce_sum,
                num_iterations=self.num_iterations,
                trl_scores_rollout=trl_scores,
                writes_gradient=self.loss_mirror.gradient_is_linear
                and type(self.token_method).micro_batch_terms is TokenMethod.micro_batch_terms,
                generation=GenerationStats(self.temperature, estimate == "full") if reads_generation else None,
            )
            if rollout_flow
            else None
        )
        self.micro_batches = MicroBatchWeigher(
            self.token_method,
            estimate,
            args.entropy_flow_diagnostics,
            rollout_flow,
            self.loss_mirror,
            self._reduce_sum,
            self._log_metrics,
            main_process,
            self._trainable_parameters,
        )
        self.reward_check = RewardCheck()
        self.add_callback(self.audit)

    def _param_estimate(self) -> ParamEstimate:
        return ParamEstimate(
            params=self._trainable_parameters,
            score=self.scorer.score_full_precision,
            jvp=self.scorer.jvp,
            loss=self.loss_mirror,
            reduce_sum=self._reduce_sum,
            num_processes=self.accelerator.num_processes,
            optimizer=self._torch_optimizer,
            max_grad_norm=self.args.max_grad_norm,
            log_metrics=self._log_metrics,
            main_process=self.accelerator.is_main_process,
            probe_rollouts=self.args.entropy_flow_probe_rollouts,
            fixed_probe=None if self._probe_prompts is None else self._fixed_probe().batches,
        )

    def _fixed_probe(self) -> FixedProbe:
        assert self._probe_prompts is not None and self.num_generations is not None  # (GRPOConfig sets it)
        return FixedProbe(
            self._probe_prompts,
            tokenize=self._tokenize_prompts,
            generate=self._generate_single_turn,
            pad_token_id=self._tokenizer.pad_token_id,
            num_generations=self.num_generations,
            batch_size=self.args.per_device_train_batch_size,
            loss_mask=self.loss_mirror.mask,
            rank=self.accelerator.process_index,
            world_size=self.accelerator.num_processes,
            seed=self.args.seed,
            device=lambda: self.accelerator.device,
        )

    # What the parts are given ---------------------------------------------------------------------------------------

    def _reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(tensor, reduction="sum")

    def _log_metrics(self, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self._metrics["train"][name].append(value)

    def _core_model(self) -> Any:
        """The causal LM carrying the fused head (unwrapped from DDP/DeepSpeed and PEFT)."""
        return core_model(self.accelerator.unwrap_model(self.model))

    def _trainable_parameters(self) -> list[torch.Tensor]:
        return [p for p in self.accelerator.unwrap_model(self.model).parameters() if p.requires_grad]

    def _torch_optimizer(self) -> Any:
        return getattr(self.optimizer, "optimizer", self.optimizer)  # inside accelerate's AcceleratedOptimizer

    @contextmanager
    def _observing(self, observer: ScoringObserver | None) -> Iterator[None]:
        self._observer = observer
        try:
            yield
        finally:
            self._observer = None

    # TRL's hooks ----------------------------------------------------------------------------------------------------

    def _generate_and_score_completions(self, inputs):
        if not self.model.training or self.rollout is None:
            return super()._generate_and_score_completions(inputs)
        capture = self.rollout.capture(self.ref_model)
        with self._observing(capture), self.rollout.recording(self._core_model()):
            output = super()._generate_and_score_completions(inputs)
        return self.rollout.generated(output, capture)

    def _prepare_inputs(self, generation_batch):
        inputs = super()._prepare_inputs(generation_batch)
        if self.rollout is not None:  # TRL has just shuffled a new rollout batch and split it into micro-batches
            self.rollout.prepare(self._buffered_inputs)
        return inputs

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, **kwargs
    ):
        observer = self._observer
        if observer is None or not observer.accepts(model):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, **kwargs
            )
        with self.scorer.capture_hidden_states(observer.needs_vocab_stats) as hidden:
            logps, entropies, aux_loss = observer.served() or super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size, compute_entropy=True, **kwargs
            )
        observer.observe(logps, entropies, self.scorer.vocab_stats(hidden, logits_to_keep))
        return logps, entropies, aux_loss

    def _compute_loss(self, model, inputs):
        if not self.model.training:
            return super()._compute_loss(model, inputs)
        call = self.micro_batches.loss_call(inputs)
        with self._observing(call):
            loss = super()._compute_loss(model, call.inputs)
        loss = self.micro_batches.finish(call, loss)
        if call.entropies_before is not None:
            self.audit.keep_batch(call.inputs, call.entropies_before, call.full_precision)
        if self.accelerator.sync_gradients:
            self.micro_batches.end_optimizer_step()
        return loss

    def create_optimizer(self, *args, **kwargs):
        optimizer = super().create_optimizer(*args, **kwargs)
        if self.param_estimate is not None:
            self.param_estimate.check_optimizer(optimizer, self.args.entropy_flow_preconditioner)
        return optimizer

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """`Trainer.train`; `resume_from_checkpoint=True` resumes the last *whole* checkpoint of output_dir."""
        checkpoint = resume_checkpoint(resume_from_checkpoint, self.args.output_dir, self.args.method)
        return super().train(checkpoint, *args, **kwargs)

    def _save_checkpoint(self, model, trial):
        method_state = lambda: (self.args.method, self.token_method.state_dict())  # noqa: E731
        run_dir, wait = self._get_output_dir(trial=trial), self.accelerator.wait_for_everyone
        with saving_checkpoint(run_dir, self.args, self.state, method_state, wait):
            super()._save_checkpoint(model, trial)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        state = None if checkpoint is None else load_method_state(checkpoint, self.args.method)
        if state is not None:
            self.token_method.load_state_dict(state)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's reward computation with every reward function's output checked: an exception, a non-number or an
        infinite reward is raised naming the function, on every process."""
        with self.reward_check.checking(self, num_completions=len(prompts)):
            rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        failed = torch.tensor(float(self.reward_check.error is not None), device=rewards.device)
        self.reward_check.raise_if_failed(int(self._reduce_sum(failed)))
        return rewards

    def _get_train_sampler(self, dataset=None):
        """TRL's sampler, drawing each epoch's order from the seed and the epoch, so a resumed run draws what an
        uninterrupted one does."""
        return EpochSeededSampler(super()._get_train_sampler(dataset))
