"""OPEFOTrainer trains the real model with every registered method: two optimizer steps on SmolLM2-135M-Instruct
(4 completions of <= 12 tokens per optimizer step), with a finite loss, weights moved by AdamW's step size,
lambda* logged on every step, and each method's own metrics at values its rule allows."""

import math
import sys
from pathlib import Path

import pytest

from opefo_trl import OPEFOConfig, OPEFOTrainer
from opefo_trl.methods import DEFAULT_METHOD, TOKEN_METHODS

sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))
from trainer_setup import base_settings, logged  # noqa: E402

pytestmark = pytest.mark.real_model

LEARNING_RATE = 1e-5
GENERATIONS, PER_STEP, MAX_COMPLETION = 2, 4, 12  # completions per prompt and per optimizer step; their tokens
#: Methods whose published runs take several updates per rollout batch and which are inert strictly on-policy (the
#: ratio is 1): here one rollout batch of 8 completions, two optimizer steps of 4 completions each, so that the
#: second step is off-policy. Every other method takes one rollout batch of 4 completions per step.
OFF_POLICY = {"clip_cov", "kl_cov", "ce_gppo"}
#: Each method's own metrics, logged on both steps.
METHOD_METRICS = {
    "grpo": [],
    "opefo": ["opefo/weighted_net"],
    "par": ["par/coef", "par/entropy"],
    "clip_cov": ["clip_cov/dropped_frac"],
    "kl_cov": ["kl_cov/penalised_frac"],
    "steer": ["steer/weight_mean", "steer/floor_frac", "steer/omega_max"],
    "stare": ["stare/gate_on", "stare/entropy", "stare/positive_frac", "stare/negative_frac"],
    "ce_gppo": ["ce_gppo/low_frac", "ce_gppo/high_frac"],
}


def characters_reward(completions, **kwargs):
    """Varied within every group (two completions of the same length are rare), so every step has a gradient."""
    return [len(c[0]["content"]) / 10 for c in completions]


def test_every_registered_method_is_trained_here():
    assert sorted(METHOD_METRICS) == sorted(TOKEN_METHODS)


@pytest.mark.parametrize("method", list(TOKEN_METHODS))
def test_two_steps_on_the_real_model_move_the_weights_and_log_the_methods_metrics(
    real_model_path, arithmetic_prompts, tmp_path, method
):
    # The default method is trained as a user gets it, without naming it.
    chosen = {} if method == DEFAULT_METHOD else {"method": method}
    rollout = {"steps_per_generation": 2} if method in OFF_POLICY else {}
    args = OPEFOConfig(
        **base_settings(
            tmp_path, **chosen, **rollout, per_device_train_batch_size=PER_STEP, num_generations=GENERATIONS,
            max_completion_length=MAX_COMPLETION, temperature=0.7, gradient_checkpointing=False,
            learning_rate=LEARNING_RATE,
        )
    )  # fmt: skip
    assert args.method == method
    trainer = OPEFOTrainer(
        model=real_model_path, reward_funcs=characters_reward, args=args, train_dataset=arithmetic_prompts
    )
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()

    for name in ("loss", "grad_norm", "entropy", "entropy_flow/lambda", *METHOD_METRICS[method]):
        values = logged(trainer, name)
        assert len(values) == 2 and all(math.isfinite(v) for v in values), (name, values)
    rewards = logged(trainer, "reward")  # logged where a rollout batch is generated
    assert len(rewards) == (1 if method in OFF_POLICY else 2) and all(math.isfinite(v) for v in rewards), rewards
    assert all(v > 0 for v in logged(trainer, "grad_norm"))
    # AdamW moves a parameter by about the learning rate per step (|m_hat / sqrt(v_hat)| <~ 1): two steps move the
    # weights, and by no more than a few learning rates.
    moved = max((p.detach() - before[name]).abs().max().item() for name, p in trainer.model.named_parameters())
    assert 0.5 * LEARNING_RATE < moved < 3 * LEARNING_RATE, moved

    # lambda* (the diagnostics', logged for every method) is the flows' balance, inside [-1, 1].
    lambdas = logged(trainer, "entropy_flow/lambda")
    assert all(-1 <= v <= 1 for v in lambdas) and any(v != 0 for v in lambdas)
    increases, decreases = logged(trainer, "entropy_flow/increase"), logged(trainer, "entropy_flow/decrease")
    for lam, increase, decrease in zip(lambdas, increases, decreases, strict=True):
        assert lam == pytest.approx((decrease - increase) / (decrease + increase), rel=1e-6)

    check_method_metrics(method, trainer, increases, decreases)
    print(
        f"method={args.method}: lambda* {lambdas}, loss {logged(trainer, 'loss')}, entropy "
        f"{logged(trainer, 'entropy')}, "
        + ", ".join(f"{name} {logged(trainer, name)}" for name in METHOD_METRICS[method])
        + f", step_time {logged(trainer, 'step_time')}, max |delta weight| {moved:.3g}"
    )


def check_method_metrics(method, trainer, increases, decreases):
    """Each method's metrics against what its rule allows on this run (defaults of its settings)."""
    entropies = logged(trainer, "entropy")  # TRL's mean token entropy of each step's tokens in the loss
    others = {m for name in METHOD_METRICS.values() for m in name} - set(METHOD_METRICS[method])
    assert not others & {key for entry in trainer.state.log_history for key in entry}
    if method == "opefo":
        # OPEFO applies lambda* (opefo/lambda_applied is logged only where it applies another lambda): the
        # reweighted flow is zero, to float32 rounding of the flow sums.
        assert logged(trainer, "opefo/lambda_applied") == []
        weighted_nets = logged(trainer, "opefo/weighted_net")
        for weighted, increase, decrease in zip(weighted_nets, increases, decreases, strict=True):
            assert abs(weighted) <= 1e-5 * (increase + decrease)
    elif method == "par":
        # The controller starts at par_coef_init 0 and moves by par_coef_step 0.05 toward the entropy target 0.2;
        # the coefficient logged is the one the step used, its entropy that step's mean (TRL's, one micro-batch).
        coefs, par_entropies = logged(trainer, "par/coef"), logged(trainer, "par/entropy")
        assert coefs[0] == 0.0
        assert coefs[1] == pytest.approx(max(0.0, 0.05 if par_entropies[0] >= 0.2 else -0.05))
        assert par_entropies == pytest.approx(entropies, rel=1e-4)
    elif method == "clip_cov":
        # max(1, int(2e-4 * n)) = 1 token of a step's n <= 4 x 12 is dropped, or none where no covariance lies in
        # (lb, ub) = (1, 5).
        for dropped in logged(trainer, "clip_cov/dropped_frac"):
            assert dropped == 0 or 1 / (4 * MAX_COMPLETION) <= dropped <= 1 / 4, dropped
    elif method == "kl_cov":
        # max(1, int(2e-3 * n)) = 1 token of each step's n (4 completions of 1 to 12 tokens) is penalised.
        for penalised in logged(trainer, "kl_cov/penalised_frac"):
            assert 1 / (4 * MAX_COMPLETION) <= penalised <= 1 / 4, penalised
    elif method == "ce_gppo":
        # Step 1 is on-policy (ratio 1: PPO's clip removes nothing). At step 2, one AdamW step of 1e-5 away, the
        # real model has moved some token's ratio out of (0.8, 1.2) (1 of 48 tokens, measured): a share in [0, 1].
        lows, highs = logged(trainer, "ce_gppo/low_frac"), logged(trainer, "ce_gppo/high_frac")
        assert lows[0] == highs[0] == 0.0
        assert 0 <= lows[1] <= 1 and 0 <= highs[1] <= 1 and lows[1] + highs[1] <= 1
    elif method == "steer":
        # exp mapping: weights in [w_min, 1] = [0.8, 1]; the token of largest change has the floor when its change
        # exceeds omega_floor 0.02, so the floor fraction is > 0 exactly then.
        for mean, floor, omega_max in zip(
            logged(trainer, "steer/weight_mean"),
            logged(trainer, "steer/floor_frac"),
            logged(trainer, "steer/omega_max"),
            strict=True,
        ):
            assert 0.8 <= mean <= 1 and 0 <= floor <= 1 and omega_max >= 0
            assert (floor > 0) == (omega_max >= 0.02), (floor, omega_max)
            assert mean < 1 or omega_max == 0
    elif method == "stare":
        # O1: the top ceil(10%) of positive-advantage tokens by surprisal (ties kept), none of the negative ones;
        # reweighted only while the rollout's mean entropy (TRL's, the same tokens at the same weights) is below 0.3.
        for gate, entropy, trl_entropy, positive, negative in zip(
            logged(trainer, "stare/gate_on"),
            logged(trainer, "stare/entropy"),
            entropies,
            logged(trainer, "stare/positive_frac"),
            logged(trainer, "stare/negative_frac"),
            strict=True,
        ):
            assert entropy == pytest.approx(trl_entropy, rel=1e-4)
            assert gate == float(entropy < 0.3)
            assert 0 < positive <= 0.5 and negative == 0, (positive, negative)
