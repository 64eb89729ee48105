"""KL-Cov on-policy under TRL's colocate vLLM generation with importance-sampling correction, on the real engine
(vLLM's CPU build; `make test-vllm`): how far TRL's re-scored old log-probs are from the training forward's, and so
what the |log r| penalty's gradient is. The on-policy warning (opefo_trl/methods/kl_cov.py) states these figures."""

import gc
import sys
from pathlib import Path

import pytest
import torch

from opefo_trl import OPEFOConfig

sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))
from trainer_setup import base_settings, make_trainer  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_on_policy_kl_cov_penalty_under_vllm_importance_sampling(
    vllm_model_path, tiny_dataset, length_reward, tmp_path, vllm_cpu_gemm
):
    """Every token's log r_t = log pi_t (training forward) - old log pi_t (TRL's no-grad pass over the same
    parameters and tokens): its sign is the penalty's gradient per penalised token (coef * sign(log r), units of the
    loss normaliser), so the penalty is inert only where the two passes agree bit for bit. Measured here and printed;
    the assertion is the warning's claim: |log r| is at float32 rounding of the two passes or 0, never a real
    policy change (both passes see the same parameters)."""
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    with pytest.warns(UserWarning, match="random sign"):
        args = OPEFOConfig(
            **base_settings(
                tmp_path, method="kl_cov", use_vllm=True, vllm_mode="colocate", vllm_max_model_length=128,
                max_steps=2, gradient_accumulation_steps=2, per_device_train_batch_size=4,
            )
        )  # fmt: skip
    trainer = make_trainer(vllm_model_path, tiny_dataset, length_reward, args)
    ratios: list[torch.Tensor] = []
    score = trainer._get_per_token_logps_and_entropies
    old: list[torch.Tensor] = []
    compute_loss = trainer.compute_loss

    def record_inputs(model, inputs, *a, **kw):
        old.append((inputs["old_per_token_logps"].detach().clone(), inputs["completion_mask"].bool().clone()))
        return compute_loss(model, inputs, *a, **kw)

    def record_scores(*a, **kw):
        result = score(*a, **kw)
        if torch.is_grad_enabled() and old and len(ratios) < len(old):  # the training forward of the last inputs
            logps = result[0].detach()
            before, mask = old[-1]
            ratios.append((logps - before)[mask])
        return result

    trainer.compute_loss, trainer._get_per_token_logps_and_entropies = record_inputs, record_scores
    try:
        trainer.train()
    finally:
        del trainer.vllm_generation.llm
        destroy_model_parallel()
        destroy_distributed_environment()
        gc.collect()
    log_ratio = torch.cat(ratios)
    nonzero = float((log_ratio != 0).float().mean())
    print(
        f"KL-Cov on the vLLM tier: {log_ratio.numel()} tokens, log r != 0 on {nonzero:.3f} of them, "
        f"max |log r| {float(log_ratio.abs().max()):.3g}, mean {float(log_ratio.abs().mean()):.3g}"
    )
    assert len(ratios) == 4  # 2 optimizer steps x 2 micro-batches
    assert float(log_ratio.abs().max()) < 1e-4  # float32 rounding of log-probs of order 10, not a policy change
