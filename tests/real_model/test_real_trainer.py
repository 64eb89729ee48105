"""OPEFOTrainer trains the real model: two optimizer steps of the default method (OPEFO) and of plain GRPO on
SmolLM2-135M-Instruct (2 prompts x 2 completions of <= 12 tokens per step), with finite metrics, weights moved by
AdamW's step size and lambda* logged on every step."""

import math
import sys
from pathlib import Path

import pytest

from opefo_trl import OPEFOConfig, OPEFOTrainer

sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))
from trainer_setup import base_settings, logged  # noqa: E402

pytestmark = pytest.mark.real_model

LEARNING_RATE = 1e-5


def characters_reward(completions, **kwargs):
    """Varied within every group (two completions of the same length are rare), so every step has a gradient."""
    return [len(c[0]["content"]) / 10 for c in completions]


@pytest.mark.parametrize("method", [None, "grpo"], ids=["default", "grpo"])
def test_two_steps_on_the_real_model_move_the_weights_and_log_lambda_star(
    real_model_path, arithmetic_prompts, tmp_path, method
):
    args = OPEFOConfig(
        **base_settings(
            tmp_path, **({} if method is None else {"method": method}), per_device_train_batch_size=4,
            num_generations=2, temperature=0.7, gradient_checkpointing=False, learning_rate=LEARNING_RATE,
        )
    )  # fmt: skip
    assert args.method == (method or "opefo")
    trainer = OPEFOTrainer(
        model=real_model_path, reward_funcs=characters_reward, args=args, train_dataset=arithmetic_prompts
    )
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()

    for name in ("loss", "grad_norm", "entropy", "reward", "entropy_flow/lambda"):
        values = logged(trainer, name)
        assert len(values) == 2 and all(math.isfinite(v) for v in values), (name, values)
    assert all(v > 0 for v in logged(trainer, "grad_norm"))
    # AdamW moves a parameter by about the learning rate per step (|m_hat / sqrt(v_hat)| <~ 1): two steps move the
    # weights, and by no more than a few learning rates.
    moved = max((p.detach() - before[name]).abs().max().item() for name, p in trainer.model.named_parameters())
    assert 0.5 * LEARNING_RATE < moved < 3 * LEARNING_RATE, moved

    lambdas = logged(trainer, "entropy_flow/lambda")
    assert all(-1 <= v <= 1 for v in lambdas) and any(v != 0 for v in lambdas)
    for lam, increase, decrease in zip(
        lambdas, logged(trainer, "entropy_flow/increase"), logged(trainer, "entropy_flow/decrease"), strict=True
    ):
        assert lam == pytest.approx((decrease - increase) / (decrease + increase), rel=1e-6)
    if method == "grpo":
        assert logged(trainer, "opefo/lambda") == []
    else:  # OPEFO applies lambda* (opefo/lambda_applied is logged only where it applies another lambda): the
        # reweighted flow is zero
        assert logged(trainer, "opefo/lambda_applied") == []
        for weighted, increase, decrease in zip(
            logged(trainer, "opefo/weighted_net"),
            logged(trainer, "entropy_flow/increase"),
            logged(trainer, "entropy_flow/decrease"),
            strict=True,
        ):
            assert abs(weighted) <= 1e-5 * (increase + decrease)
    print(
        f"method={args.method}: lambda* {lambdas}, loss {logged(trainer, 'loss')}, entropy "
        f"{logged(trainer, 'entropy')}, step_time {logged(trainer, 'step_time')}, max |delta weight| {moved:.3g}"
    )
