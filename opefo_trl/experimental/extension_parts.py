"""How `OPEFOTrainer` builds the parts of this library's extensions, for `opefo_trl.trainer.parts.build_parts`: the
`param` estimate (with its fixed probe) and the entropy audit.

Each builder takes the trainer's `opefo_trl.trainer.parts.TrainerAccess` and the core parts it reads (scorer, loss
mirror) as arguments; this module imports the trainer's modules only for their types (`trainer/parts.py`, which
builds every part of the trainer, imports it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from opefo_trl.experimental.entropy_audit import EntropyAudit
from opefo_trl.experimental.fixed_probe import FixedProbe
from opefo_trl.experimental.param_estimate import ParamEstimate

if TYPE_CHECKING:
    from opefo_trl.trainer.loss_mirror import LossMirror
    from opefo_trl.trainer.parts import TrainerAccess
    from opefo_trl.trainer.scoring import Scorer


def build_audit(trainer: Any, access: TrainerAccess, scorer: Scorer, loss_mirror: LossMirror) -> EntropyAudit:
    """The entropy audit of ``entropy_flow_audit_steps`` (inactive at 0)."""
    return EntropyAudit(
        every=trainer.args.entropy_flow_audit_steps,
        global_step=lambda: trainer.state.global_step,
        score=scorer.score,
        score_full_precision=scorer.score_full_precision,
        loss_mask=loss_mirror.mask,
        reduce_sum=access.reduce_sum,
        device=access.device,
        log_metrics=access.log_metrics,
        params=access.trainable_parameters,
        optimizer=access.torch_optimizer,
    )


def build_param_estimate(
    trainer: Any, access: TrainerAccess, scorer: Scorer, loss_mirror: LossMirror, probe_prompts: Any = None
) -> ParamEstimate:
    """The `param` estimate of a built trainer's rollout batches (``probe_prompts``: the fixed probe's prompts)."""
    return ParamEstimate(
        params=access.trainable_parameters,
        score=scorer.score_full_precision,
        jvp=scorer.jvp,
        loss=loss_mirror,
        reduce_sum=access.reduce_sum,
        num_processes=trainer.accelerator.num_processes,
        optimizer=access.torch_optimizer,
        max_grad_norm=trainer.args.max_grad_norm,
        log_metrics=access.log_metrics,
        main_process=trainer.accelerator.is_main_process,
        probe_rollouts=trainer.args.entropy_flow_probe_rollouts,
        fixed_probe=None if probe_prompts is None else fixed_probe(trainer, loss_mirror, probe_prompts).batches,
    )


def fixed_probe(trainer: Any, loss_mirror: LossMirror, probe_prompts: Any) -> FixedProbe:
    """The fixed probe of ``probe_prompts``, sampled by TRL's generation path of ``trainer``."""
    assert trainer.num_generations is not None  # (GRPOConfig sets it)
    return FixedProbe(
        probe_prompts,
        tokenize=trainer._tokenize_prompts,
        generate=trainer._generate_single_turn,
        pad_token_id=trainer._tokenizer.pad_token_id,
        num_generations=trainer.num_generations,
        batch_size=trainer.args.per_device_train_batch_size,
        loss_mask=loss_mirror.mask,
        rank=trainer.accelerator.process_index,
        world_size=trainer.accelerator.num_processes,
        seed=trainer.args.seed,
        device=lambda: trainer.accelerator.device,
    )
