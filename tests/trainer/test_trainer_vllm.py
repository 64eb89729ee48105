"""OPEFOTrainer with TRL's colocate vLLM generation, on the real engine (vLLM's CPU build; `make test-vllm`).

Which log-probs lambda* is computed from, and whether vLLM generates from the weights being trained, are invisible
around a missing engine: here the rollout is sampled by vLLM (a bf16 engine whose log-probs differ from the trainer's)
and every lambda* is recomputed from the trainer's own scoring pass over the same completions at the same parameters.
"""

import gc

import pytest
import torch
from trainer_setup import base_settings, logged, make_trainer, spy

from opefo_trl import OPEFOConfig
from opefo_trl.maths.entropy_flow import flow_per_unit_advantage, flow_stats

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def vllm_settings(tmp_path, **overrides):
    return base_settings(
        tmp_path, use_vllm=True, vllm_mode="colocate", vllm_max_model_length=128, max_steps=2, **overrides
    )


def lambda_from_scoring(trainer, batches) -> float:
    """lambda* of a rollout's micro-batches from the trainer's own scoring pass (``Scorer.score``) at the current
    parameters."""
    totals = None
    estimate = trainer.args.entropy_flow_estimate
    for batch in batches:
        scores = trainer.scorer.score(batch, vocab=estimate == "full")
        advantages = batch["advantages"].float()
        factor = trainer.loss_mirror.factor(batch, scores.logps, scores.entropies, advantages)
        unit = flow_per_unit_advantage(scores.logps, scores.entropies, estimate, *scores.vocab)
        stats = flow_stats(advantages.unsqueeze(1) * unit, factor)
        totals = stats if totals is None else totals + stats
    return float(totals.lambda_star)


def record_expected_lambdas(trainer, record):
    """Append to ``record`` each rollout's lambda* from the trainer's own scoring: before OPEFO weighs the rollout
    (``rollout.weigh``), or, for a baseline with diagnostics, at its one micro-batch's loss (``compute_loss``)."""

    def weigh(original, batches):
        record.append(lambda_from_scoring(trainer, batches))
        return original(batches)

    def compute_loss(original, model, inputs, *args, **kwargs):
        record.append(lambda_from_scoring(trainer, [inputs]))
        return original(model, inputs, *args, **kwargs)

    if trainer.rollout is not None:
        spy(trainer.rollout, "weigh", weigh)
    else:
        assert trainer.args.gradient_accumulation_steps == 1  # one micro-batch per rollout
        spy(trainer, "compute_loss", compute_loss)


def release(trainer):
    """Free the colocated engine, so that the next test's can start in this process."""
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    del trainer.vllm_generation.llm
    destroy_model_parallel()
    destroy_distributed_environment()
    gc.collect()


# Tolerance of lambda*: the trainer's scoring pass and TRL's old-log-prob pass are float32 forwards of the same
# parameters on the same tokens (batch composition and kernels may differ), so each log pi_t / H_t differs by a few
# float32 ulps of values of order 10 (|log pi| < log V ~ 6, H ~ 6): ~1e-5 at most. u_t moves by as much relative to
# (1 - pi)^2 |log pi + H| ~ 1, and lambda* = (N - P) / (N + P) by at most twice the relative change of P and N:
# 1e-4 leaves a margin of 5, and is ten times below the ~1e-3 shift vLLM's bf16 sampling log-probs cause.
LAMBDA_TOLERANCE = 1e-4


@pytest.mark.parametrize(
    ("method", "estimate", "correction"),
    [
        ("opefo", "opefo", True),
        ("opefo", "opefo", False),
        ("opefo", "full", True),
        ("opefo", "full", False),
        ("grpo", "opefo", True),
        ("grpo", "opefo", False),
    ],
)
def test_colocate_lambda_is_the_trainers_own_scoring(
    vllm_model_path, tiny_dataset, length_reward, tmp_path, vllm_cpu_gemm, method, estimate, correction
):
    """lambda* under vLLM comes from the trainer's log-probs (TRL's old-log-prob pass with importance-sampling
    correction, OPEFO's own scoring without), never from vLLM's sampling log-probs, whose difference TRL logs."""
    extra = {"entropy_flow_diagnostics": True} if method == "grpo" else {}
    args = OPEFOConfig(
        **vllm_settings(
            tmp_path,
            method=method,
            entropy_flow_estimate=estimate,
            vllm_importance_sampling_correction=correction,
            **extra,
        )
    )
    trainer = make_trainer(vllm_model_path, tiny_dataset, length_reward, args)
    try:
        expected: list[float] = []
        record_expected_lambdas(trainer, expected)
        trainer.train()
        lambdas = logged(trainer, "entropy_flow/lambda")
        assert len(expected) == len(lambdas) == 2
        assert lambdas == pytest.approx(expected, abs=LAMBDA_TOLERANCE)
        # vLLM sampled the rollout: with the correction, TRL logs how far its log-probs are from the trainer's.
        differences = logged(trainer, "sampling/sampling_logp_difference/mean")
        assert len(differences) == (2 if correction else 0) and all(d > 0 for d in differences)
    finally:
        release(trainer)


def vllm_weights(trainer) -> dict[str, torch.Tensor]:
    model = trainer.vllm_generation.llm.llm_engine.model_executor.driver_worker.model_runner.model
    return {name: param.detach().float().clone() for name, param in model.named_parameters()}


def test_colocate_weight_sync_is_real(vllm_model_path, tiny_dataset, length_reward, tmp_path, vllm_cpu_gemm):
    """After training with the `param` estimate, vLLM's weights are the trainer's (to bf16 rounding) and no longer the
    initial ones: the rollouts were generated by the policy being trained."""
    from transformers import AutoModelForCausalLM

    args = OPEFOConfig(**vllm_settings(tmp_path, method="opefo", entropy_flow_estimate="param", learning_rate=1e-2))
    trainer = make_trainer(vllm_model_path, tiny_dataset, length_reward, args)
    try:
        trainer.train()
        assert len(logged(trainer, "entropy_flow/lambda")) == 2
        trainer.vllm_generation.sync_weights()  # the sync the next rollout would start with
        served = vllm_weights(trainer)
        start = dict(AutoModelForCausalLM.from_pretrained(vllm_model_path).named_parameters())
        trained = dict(trainer.model.named_parameters())
        # vLLM fuses q/k/v and gate/up: compare the layers it keeps whole.
        names = [name for name in served if name in trained and "embed" not in name]
        assert any("o_proj" in name for name in names) and any("down_proj" in name for name in names)
        for name in names:
            now, before = trained[name].detach().float(), start[name].detach().float()
            # bf16 keeps 8 significant bits: rounding moves each weight by at most 2^-8 of its magnitude.
            assert torch.allclose(served[name], now, rtol=2**-8, atol=1e-6), name
            moved = (now - before).abs().max()
            assert moved > 10 * (2**-8) * before.abs().max() or moved > 1e-3, name
            assert (served[name] - before).abs().max() > 0.5 * moved, name
    finally:
        release(trainer)
