"""`OPEFOTrainer`: TRL's `GRPOTrainer` with a pluggable token-level method (OPEFO by default).

The trainer holds only `__init__` and TRL's hooks; each hook hands over to a part of this package:

- `_generate_and_score_completions` (once per rollout batch): `token_weights.RolloutWeigher`, which sets the
  rollout's (B, T) advantages there, before TRL's shuffle and split, or, where f_t depends on the split (`bnpo`, the
  high-entropy mask, the `param` estimate with `experimental.param_estimate.ParamEstimate`), at the first
  `compute_loss` after it; before the first generation, `checks.check_finite_policy` (the loaded weights hold no NaN
  or inf);
- `compute_loss` (public; every micro-batch): `token_weights.MicroBatchWeigher`, with `loss_mirror.LossMirror` (TRL's
  per-token factor and loss aggregation): the methods' loss-time terms, the diagnostics and the one-time guard;
- `_get_per_token_logps_and_entropies` (every TRL scoring call): the scoring observer of the hook in progress, if any
  (TRL's old-log-prob pass over a new rollout: a `token_weights.RolloutCapture`; the loss forward: a
  `token_weights.LossCall`);
- the extensions' hooks (`experimental.trainer_hooks.ExtensionHooks`, a mixin): around the optimizer step, the
  audit (`experimental.entropy_audit.EntropyAudit`, a callback), and `create_optimizer`,
  `ParamEstimate.check_optimizer`;
- `train` (resume from the last *whole* checkpoint, with the method's state) and `_save_checkpoint` (whole or
  removed): `opefo_trl.runs`; the reward functions (`reward_funcs`,
  checked from the end of `__init__`): `checks.RewardCheck`; each epoch's data order (a callback):
  `sampler.EpochSeededOrder`.

The parts are built, and given what they need of the trainer, by `parts.build_parts`; the trainer's own forwards go
through `scoring.Scorer`; the policy's precision set-up is `model_setup`. The TRL code
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

import logging
import os
from functools import partial

import torch

from opefo_trl._compat import check_installed_trl

check_installed_trl()

from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.trainer.utils import get_config_model_id  # noqa: E402

from opefo_trl.experimental.fixed_probe import check_probe_dataset  # noqa: E402
from opefo_trl.experimental.trainer_hooks import ExtensionHooks  # noqa: E402
from opefo_trl.methods import TokenMethod, get_token_method_class  # noqa: E402
from opefo_trl.runs import (  # noqa: E402
    check_resume_options,
    check_rollout_boundary,
    load_method_state,
    resume_checkpoint,
    saving_checkpoint,
)
from opefo_trl.runs.options import save_run_options  # noqa: E402
from opefo_trl.trainer import model_setup  # noqa: E402
from opefo_trl.trainer.checks import (  # noqa: E402
    check_dropout,
    check_finite_policy,
    check_save_steps,
    check_training_values,
    check_vllm_setup,
    dataset_steps_per_epoch,
)
from opefo_trl.trainer.config import OPEFOConfig, with_opefo_settings  # noqa: E402
from opefo_trl.trainer.parts import TrainerAccess, build_parts  # noqa: E402
from opefo_trl.trainer.sampler import EpochSeededOrder  # noqa: E402
from opefo_trl.trainer.token_weights import ScoringObserver  # noqa: E402

logger = logging.getLogger(__name__)

#: The OPEFO paper's BibTeX entry, as the model card cites it.
OPEFO_CITATION = """\
@inproceedings{xu2026opefo,
    title     = {{Understanding and Preventing Entropy Collapse in RLVR with On-Policy Entropy Flow Optimization}},
    author    = {Xu and Zhao and Wu and Luu},
    booktitle = {Findings of the Association for Computational Linguistics: ACL 2026},
    year      = 2026,
    eprint    = {arXiv:2605.11491},
}"""


class OPEFOTrainer(ExtensionHooks, GRPOTrainer):
    """A drop-in [`~trl.GRPOTrainer`] whose per-token policy-gradient terms are weighted by a token method.

    Takes exactly `GRPOTrainer`'s arguments (`reward_funcs` optional with an `environment_factory` that owns the
    reward; `args=None`: `GRPOConfig`'s defaults in `<model>-GRPO`, as `GRPOTrainer` names it), and `probe_dataset`: a
    data set of prompts (a `prompt` column, as `train_dataset`) never trained on, whose completions, sampled once at
    the start, the `param` flow measures the entropy of too (`experimental.fixed_probe`), and `run_inputs`: what the
    run trains on, as `opefo_trl.runs.training_inputs` gives it (`opefo-train` does), recorded in every checkpoint and
    refused on resume when it differs (None: not recorded, not compared). `args` is an
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
    # What TRL's `create_model_card` names and cites (GRPOTrainer's own entry would name DeepSeekMath alone); GRPO's
    # citation follows OPEFO's, as OPEFO reweights GRPO's loss.
    _paper = {
        "title": "Understanding and Preventing Entropy Collapse in RLVR with On-Policy Entropy Flow Optimization",
        "id": "2605.11491",
        "citation": OPEFO_CITATION + "\n\n" + GRPOTrainer._paper["citation"],
    }
    #: An `OPEFOConfig`, or a `GRPOConfig` given every OPEFO option by `with_opefo_settings`.
    args: OPEFOConfig
    #: What TRL's scoring calls inside the hook in progress are handed to, if anything (also while TRL builds).
    _scoring_observer: ScoringObserver | None = None
    #: The checkpoint `train` resumes from, if any: where the policy's weights come from.
    _resumed_checkpoint: str | None = None
    #: Whether the policy's weights were found finite (checked once, before the first generation).
    _policy_checked: bool = False
    #: What the run trains on (`opefo_trl.runs.training_inputs`), recorded in every checkpoint, compared on resume.
    run_inputs: dict | None = None
    #: The optimizer steps of an epoch over the training data (None: an iterable data set), for the rollout boundaries.
    _steps_per_epoch: int | None = None

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: OPEFOConfig | GRPOConfig | None = None,
        *pargs,
        probe_dataset=None,
        run_inputs=None,
        **kwargs,
    ):
        if args is None:  # the output_dir GRPOTrainer (TRL 1.16) defaults to, so that swapping the class moves nothing
            name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = OPEFOConfig(output_dir=f"{name.split('/')[-1]}-GRPO")
        args = with_opefo_settings(args)
        self.run_inputs = run_inputs
        self._steps_per_epoch = dataset_steps_per_epoch(kwargs.get("train_dataset", pargs[0] if pargs else None), args)
        check_training_values(args)
        check_save_steps(args, self._steps_per_epoch)
        check_vllm_setup(args, model)
        check_dropout(args, model, kwargs.get("peft_config"))
        self.token_method: TokenMethod = get_token_method_class(args.method).from_config(args)
        probe_prompts = check_probe_dataset(probe_dataset, args, self.token_method.needs_rollout_pass)
        model_setup.keep_float64_head(model, args)
        cast_peft_head = model_setup.casts_peft_head(model, args, (reward_funcs, args, *pargs), kwargs)
        with model_setup.trl_builds_without_head_cast(args, cast_peft_head):
            super().__init__(model, reward_funcs, args, *pargs, **kwargs)
        if cast_peft_head:
            model_setup.cast_peft_lm_head_to_fp32(TrainerAccess(self).core_model(), self.temperature)
        parts = build_parts(self, probe_prompts)
        self.access, self.scorer, self.loss_mirror = parts.access, parts.scorer, parts.loss_mirror
        self.audit, self.param_estimate, self.rollout = parts.audit, parts.param_estimate, parts.rollout
        self.micro_batches, self.reward_check = parts.micro_batches, parts.reward_check
        #: Where lambda*'s log pi_t and H_t come from in this configuration (None: no rollout pass), logged once.
        self.scores_source = parts.scores_source
        if self.scores_source is not None and self.accelerator.is_main_process:
            logger.info("OPEFOTrainer: the rollout's log pi and entropy come from %s.", self.scores_source)
        # TRL's reward computation calls `self.reward_funcs` (the environment's reward included): checked functions
        # from here on, under the names TRL gave them.
        self.reward_funcs = self.reward_check.wrap(self.reward_funcs, self.reward_func_names)
        self.attach_extensions()
        self.add_callback(EpochSeededOrder())

    # TRL's hooks ----------------------------------------------------------------------------------------------------

    def _generate_and_score_completions(self, inputs):
        if not self._policy_checked:  # after a resume has loaded its checkpoint's weights
            where = self._resumed_checkpoint or get_config_model_id(self.access.core_model().config)
            model = self.accelerator.unwrap_model(self.model)
            check_finite_policy(
                model, where, self._resumed_checkpoint is not None, self.access.reduce_sum, self.accelerator.device
            )
            self._policy_checked = True
        self.reward_check.start()
        if not self.model.training or self.rollout is None:
            output = super()._generate_and_score_completions(inputs)
            self._raise_if_a_reward_failed()
            return output
        self._scoring_observer = capture = self.rollout.capture(self.ref_model)
        try:
            with self.rollout.recording(self.access.core_model):
                output = super()._generate_and_score_completions(inputs)
        finally:
            self._scoring_observer = None
        self._raise_if_a_reward_failed()
        return self.rollout.generated(output, capture)

    def _raise_if_a_reward_failed(self) -> None:
        """A reward function's failure (an exception, a non-number, an infinite reward), raised naming the function
        on every process, before anything trains on the rollout (the failed function's rewards were zeros)."""
        failed = torch.tensor(float(self.reward_check.error is not None), device=self.accelerator.device)
        self.reward_check.raise_if_failed(int(self.access.reduce_sum(failed)))

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, **kwargs
    ):
        scoring = super()._get_per_token_logps_and_entropies
        observer = self._scoring_observer
        if observer is None or not observer.accepts(model):
            return scoring(model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, **kwargs)
        trl_score = partial(scoring, model, input_ids, attention_mask, logits_to_keep, batch_size, True, **kwargs)
        return observer.scored(trl_score, logits_to_keep)  # with entropies, which the observers read

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not self.model.training:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self.rollout is not None:  # a rollout weighed after TRL's split is weighed at its first loss
            self.rollout.prepare(self._buffered_inputs, inputs)
        self._scoring_observer = call = self.micro_batches.loss_call(inputs)
        try:
            loss = super().compute_loss(model, call.inputs, return_outputs, num_items_in_batch)
        finally:
            self._scoring_observer = None
        loss = self.micro_batches.finish(call, loss)
        self.after_loss(call)
        if self.accelerator.sync_gradients:
            self.micro_batches.end_optimizer_step()
        return loss

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """`Trainer.train`; `resume_from_checkpoint=True` resumes the last *whole* checkpoint of output_dir. A resume
        also restores the token method's state (`opefo_method_state.json`, e.g. PAR's coefficient)."""
        checkpoint = resume_checkpoint(resume_from_checkpoint, self.args.output_dir, self.args.method)
        if checkpoint is not None:
            for change in check_resume_options(checkpoint, self.args, self.run_inputs):  # refuses what differs
                logger.warning(change)
            # TRL's rollout buffer is not in the checkpoint: refused where the token weights come from the rollout
            check_rollout_boundary(checkpoint, self.args, self._steps_per_epoch, self.token_method.weighs_tokens())
            # Loaded here, on every process, rather than through transformers' `ExportableState`: that restores only
            # callbacks, only with `restore_callback_states_from_checkpoint=True`, and by rebuilding each callback
            # from the JSON of its constructor arguments, whereas the method is no callback and its state must be
            # restored on every resume (and its file checked, with the method's name, before the weights load).
            state = load_method_state(checkpoint, self.args.method)
            if state is not None:
                self.token_method.load_state_dict(state)
        self._resumed_checkpoint, self._policy_checked = checkpoint, False
        return super().train(checkpoint, *args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """`Trainer.save_model`, and beside the model the run's options and what it trained on, as every checkpoint
        records them (`opefo_run_options.json`): `opefo-eval` takes the prompt template and reward mode from there."""
        super().save_model(output_dir, _internal_call)
        folder = output_dir or self.args.output_dir
        # A checkpoint's own save records them after its files; a sharded FSDP save writes no folder here.
        if self.args.should_save and not _internal_call and folder is not None and os.path.isdir(folder):
            save_run_options(folder, self.args, self.run_inputs)

    def _save_checkpoint(self, model, trial):
        method_state = lambda: (self.args.method, self.token_method.state_dict())  # noqa: E731
        run_dir, wait = self._get_output_dir(trial=trial), self.accelerator.wait_for_everyone
        with saving_checkpoint(run_dir, self.args, self.state, method_state, wait, self.run_inputs):
            super()._save_checkpoint(model, trial)
