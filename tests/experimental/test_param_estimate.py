"""opefo_trl.experimental.param_estimate through the trainer: the gradient the step balance writes instead of TRL's
training pass is the one TRL's own pass computes, for every loss type, and it is written only where it is exact."""

import sys
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback, set_seed

from opefo_trl.trainer.loss_mirror import LOSS_TYPES

sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))  # trainer_setup: the trainer tests' helpers
from trainer_setup import first_rollout, logged, make_config, make_trainer, spy  # noqa: E402

pytestmark = pytest.mark.numerics

STEP_BALANCE = dict(
    entropy_flow_estimate="param", opefo_balance="step", gradient_accumulation_steps=2, per_device_train_batch_size=4
)


class Gradients(TrainerCallback):
    """The gradient the optimizer is about to apply, and the backbone forwards that are not single-token decoding."""

    def __init__(self, trainer):
        self.trainer, self.gradients, self.forwards = trainer, [], 0
        backbone = trainer.accelerator.unwrap_model(trainer.model).base_model
        backbone.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.forwards += int(ids is None or ids.shape[-1] > 1)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.gradients.append([p.grad.detach().clone() for p in self.trainer.access.trainable_parameters()])


def _first_step(tiny_model_path, tiny_dataset, length_reward, tmp_path, writes, prepare=None, **overrides):
    set_seed(0)
    args = make_config(tmp_path, max_steps=1, max_grad_norm=0, optim="adamw_torch", **STEP_BALANCE, **overrides)
    trainer = make_trainer(tiny_model_path, tiny_dataset, length_reward, args)
    if prepare is not None:
        prepare(trainer)
    assert trainer.rollout.writes_gradient
    trainer.rollout.writes_gradient = writes
    recorded = Gradients(trainer)
    trainer.add_callback(recorded)
    trainer.train()
    return trainer, recorded


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_the_written_gradient_is_the_one_trls_own_pass_computes(
    tiny_model_path, tiny_dataset, length_reward, tmp_path, loss_type
):
    """The same first rollout, lambda and parameters: g = a + lambda b written into .grad against the gradient of
    TRL's own loss. Both are float32 sums of the same per-token terms through two float32 LM heads (TRL's fused one,
    the estimate's own), so they agree to float32 rounding of the largest entry, ~1e-7 relative; 1e-5 is the bound.
    A copy that wrote a alone (lambda ignored) or scaled by the accumulation twice is off by ~lambda |b| or 2x."""
    extra = dict(vllm_importance_sampling_mode="token_truncate") if loss_type == "vespo" else {}
    runs = {
        writes: _first_step(
            tiny_model_path, tiny_dataset, length_reward, tmp_path, writes, loss_type=loss_type, **extra
        )
        for writes in (True, False)
    }
    (written,), (trl,) = runs[True][1].gradients, runs[False][1].gradients
    scale = max(float(g.abs().max()) for g in trl)
    for ours, theirs in zip(written, trl, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5 * scale)
    logs = {writes: trainer.state.log_history[0] for writes, (trainer, _) in runs.items()}
    assert logs[True]["entropy_flow/lambda"] == logs[False]["entropy_flow/lambda"] != 0
    assert logs[True]["loss"] == pytest.approx(logs[False]["loss"], rel=1e-5, abs=1e-9)  # TRL's metrics still logged
    assert logs[True]["entropy"] == pytest.approx(logs[False]["entropy"], rel=1e-5)
    # TRL's training pass (one forward per micro-batch) is not run.
    assert runs[False][1].forwards - runs[True][1].forwards == 2


@pytest.mark.slow
def test_the_written_gradient_carries_the_vllm_importance_ratio(
    tiny_model_path, tiny_dataset, length_reward, tmp_path, monkeypatch
):
    """As above with TRL's vLLM importance-sampling correction: each token's ratio (0.3 to 1.7, drawn per rollout) is
    part of f_t, so the written g = a + lambda b must carry it as TRL's pass does (same float32 bound). Generation
    runs without vLLM here: the ratio is put into TRL's rollout batch and TRL's loss applies it (use_vllm is on only
    inside _compute_loss). A mirror without the ratio writes a gradient off by ~0.3 of its largest entry."""
    from trl import GRPOTrainer

    generate, compute_loss = GRPOTrainer._generate_and_score_completions, GRPOTrainer._compute_loss

    def generate_with_ratio(self, inputs):
        output = generate(self, inputs)
        gen = torch.Generator().manual_seed(1)
        output["importance_sampling_ratio"] = 0.3 + 1.4 * torch.rand(output["completion_ids"].shape, generator=gen)
        return output

    def loss_with_correction(self, model, inputs):
        self.use_vllm = True
        try:
            return compute_loss(self, model, inputs)
        finally:
            self.use_vllm = False

    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", generate_with_ratio)
    monkeypatch.setattr(GRPOTrainer, "_compute_loss", loss_with_correction)

    def with_correction(trainer):
        trainer.loss_mirror.importance_sampling_correction = True  # what LossMirror.of reads from a vLLM trainer

    runs = {
        writes: _first_step(tiny_model_path, tiny_dataset, length_reward, tmp_path, writes, with_correction)
        for writes in (True, False)
    }
    (written,), (trl,) = runs[True][1].gradients, runs[False][1].gradients
    scale = max(float(g.abs().max()) for g in trl)
    for ours, theirs in zip(written, trl, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5 * scale)
    assert runs[True][0].state.log_history[0]["entropy_flow/lambda"] != 0


@pytest.mark.parametrize(
    "overrides, linear",
    [
        (dict(), True),
        (dict(beta=0.1, opefo_balance="batch"), False),  # the KL term's gradient is not the factor's
        (dict(method="grpo", entropy_coef=1e-3), False),  # nor is TRL's entropy bonus
        (dict(opefo_balance="batch", num_iterations=2, allow_off_policy=True), False),  # ratio != 1 on the second pass
    ],
    ids=["step_balance", "kl", "entropy_bonus", "off_policy"],
)
def test_trls_gradient_is_linear_in_the_weights_only_on_policy_without_other_terms(
    tiny_model_path, tiny_dataset, length_reward, tmp_path, overrides, linear
):
    settings = {**STEP_BALANCE, **overrides}
    if settings.get("method") == "grpo":
        settings.pop("opefo_balance")
    trainer = make_trainer(tiny_model_path, tiny_dataset, length_reward, make_config(tmp_path, **settings))
    assert trainer.loss_mirror.gradient_is_linear is linear
    if trainer.rollout is not None:
        assert trainer.rollout.writes_gradient is linear


@pytest.mark.parametrize("balance, passes", [("batch", 7), ("step", 7)])
def test_the_step_balance_costs_the_batch_balance_s_passes(
    tiny_model_path, tiny_dataset, length_reward, tmp_path, balance, passes
):
    """Backbone forwards besides decoding, accumulation 2: GRPO's (prefill, 2 training forwards) + the estimate's
    (a gradient forward and a forward-mode pass per micro-batch); the step balance adds b's forward per micro-batch
    and saves TRL's training pass."""
    args = make_config(tmp_path, max_steps=1, **{**STEP_BALANCE, "opefo_balance": balance})
    trainer = make_trainer(tiny_model_path, tiny_dataset, length_reward, args)
    recorded = Gradients(trainer)
    trainer.add_callback(recorded)
    trainer.train()
    assert recorded.forwards == passes


def test_a_method_with_micro_batch_terms_keeps_trls_pass(
    tiny_model_path, tiny_dataset, length_reward, tmp_path, monkeypatch
):
    from opefo_trl.methods import OPEFO, TokenTerms

    monkeypatch.setattr(OPEFO, "micro_batch_terms", lambda self, batch, logps, context=None: TokenTerms())
    with pytest.warns(UserWarning, match=r"adds micro-batch terms .* TRL's training pass is run instead"):
        trainer = make_trainer(tiny_model_path, tiny_dataset, length_reward, make_config(tmp_path, **STEP_BALANCE))
    assert trainer.loss_mirror.gradient_is_linear and not trainer.rollout.writes_gradient


def test_the_gradient_is_formed_from_the_lambda_and_signs_the_method_declared(
    tiny_model_path, tiny_dataset, length_reward, tmp_path
):
    """ParamEstimate.finish reads lam and the signs from the method's RolloutWeights: g = a + lam b when they are those
    of the step model it built; weights of another form declare no lam and TRL's pass computes the gradient (no guess,
    no warning); signs other than the step model's are a method's error, raised."""
    import warnings
    from types import SimpleNamespace

    from opefo_trl.methods import RolloutWeights

    trainer = make_trainer(tiny_model_path, tiny_dataset, length_reward, make_config(tmp_path, **STEP_BALANCE))
    estimate, signs = trainer.param_estimate, torch.tensor([[1.0, -1.0, 0.0]])

    def finish(decided, gradient=True):
        model = SimpleNamespace(a=[torch.tensor([1.0, 2.0])], b=[torch.tensor([10.0, -10.0])])
        estimate._step = (signs, model)  # what step_change keeps when the method builds the step model
        return estimate.finish(decided, gradient)

    (g,) = finish(RolloutWeights.affine(0.25, signs))
    assert g.tolist() == [3.5, -0.5]
    (g,) = finish(RolloutWeights.affine(0.25, signs.clone()))  # equal signs, another tensor
    assert g.tolist() == [3.5, -0.5]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert finish(RolloutWeights(1.0 + 0.25 * signs)) is None  # 1 + lam s_t in value, but not declared so
        assert finish(RolloutWeights()) is None
    assert finish(RolloutWeights.affine(0.25, signs), gradient=False) is None
    with pytest.raises(RuntimeError, match="declare signs other than those it built the step model with"):
        finish(RolloutWeights.affine(0.25, -signs))
    assert estimate.finish(RolloutWeights.affine(0.25, signs), True) is None  # no step model built this rollout


def _first_rollout(trainer):
    """The micro-batches of the trainer's first rollout, before they are weighed."""
    trainer.create_optimizer()
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    captured = []
    spy(trainer.rollout, "weigh", lambda weigh, batches: captured.append([dict(b) for b in batches]))
    first_rollout(trainer)
    return captured[0]


def _lambda_star(trainer, batches, jitter_seed=None):
    """lambda* of the `param` estimate of one rollout's micro-batches (the parameters optionally multiplied by
    1 + 1e-7 N(0, 1) first, and restored)."""
    from opefo_trl.trainer.batch_state import RolloutItem
    from opefo_trl.trainer.token_weights import per_token

    saved = [p.detach().clone() for p in trainer.model.parameters()]
    if jitter_seed is not None:
        noise = torch.Generator().manual_seed(jitter_seed)
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.mul_(1 + 1e-7 * torch.randn(p.shape, generator=noise, dtype=torch.float64).to(p.dtype))
    items = [RolloutItem(dict(b), per_token(b["advantages"], b["completion_mask"]).float()) for b in batches]
    lam = trainer.param_estimate.estimate(items)[1].lambda_star
    with torch.no_grad():
        for p, s in zip(trainer.model.parameters(), saved, strict=True):
            p.copy_(s)
    return lam


@pytest.mark.numerics
def test_lambda_star_of_the_warm_model_is_its_float64_one_and_ignores_a_1e7_jitter(
    warm_model_path, tiny_dataset, length_reward, tmp_path, keep_dtype_rms_norm
):
    """The warm tiny model's first rollout (2 micro-batches; AdamW's first step, whose D = 1 / (|g| + eps) makes lambda*
    the most sensitive): the float32 trainer's lambda* within 2.5e-5 (a tenth of the paper's smallest lambda*) of the
    same weights' in float64 (measured 1.1e-5 and 1.6e-5 under the two kernel settings on an Intel CPU, 8e-6 on an
    AMD EPYC). After every parameter is multiplied by 1 + 1e-7 N(0, 1), float32 and float64 differ by up to 3.0e-5
    (measured on both CPUs; bound 5e-5): Adam's first D divides by |a_i|, and a_i is a float32 sum that cancels. The
    jitter moves lambda* itself too (up to 1.3e-5 in float64); float32 moves it by at most that plus the two float32
    errors (bound 2 x 5e-5; measured 5.2e-5 on the AMD CPU, where float32 erred by +8e-6 and -3.0e-5)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    settings = {k: v for k, v in STEP_BALANCE.items() if k != "opefo_balance"}
    fp32 = make_trainer(warm_model_path, tiny_dataset, length_reward, make_config(tmp_path, **settings))
    batches = _first_rollout(fp32)
    model64 = keep_dtype_rms_norm(AutoModelForCausalLM.from_pretrained(warm_model_path, dtype=torch.float64))
    fp64 = make_trainer(
        model64, tiny_dataset, length_reward, make_config(tmp_path, **settings),
        processing_class=AutoTokenizer.from_pretrained(warm_model_path),
    )  # fmt: skip
    fp64.create_optimizer()
    fp64.current_gradient_accumulation_steps = 2
    reference, ours = _lambda_star(fp64, batches), _lambda_star(fp32, batches)
    assert abs(reference) > 1e-3
    assert abs(ours - reference) < 2.5e-5, (ours, reference)
    for seed in range(2):
        jittered, jittered64 = _lambda_star(fp32, batches, seed), _lambda_star(fp64, batches, seed)
        assert abs(jittered - jittered64) < 5e-5, (seed, jittered, jittered64)
        assert abs(jittered - ours) < abs(jittered64 - reference) + 2 * 5e-5


def test_a_probe_of_earlier_rollouts_is_what_the_step_balance_holds_and_the_audit_measures(
    warm_model_path, tiny_dataset, length_reward, tmp_path
):
    """entropy_flow_probe_rollouts=3: the estimate of step k sees the micro-batches of the min(k, 3) - 1 rollouts
    before it; the step balance zeroes the first-order change of the probe's mean entropy, and the audit re-scores
    the whole probe after the real AdamW step: what it measures is second order, far below what GRPO's step would
    have changed the same probe by to first order (opefo/step_change_unweighted)."""
    from opefo_trl.experimental.param_estimate import ParamEstimate

    args = make_config(
        tmp_path, max_steps=3, learning_rate=1e-5, optim="adamw_torch", max_grad_norm=1e9, entropy_flow_audit_steps=1,
        entropy_flow_probe_rollouts=3, **STEP_BALANCE,
    )  # fmt: skip
    trainer = make_trainer(warm_model_path, tiny_dataset, length_reward, args)
    probe_sizes = []

    def record(estimate, items):
        result = estimate(items)
        probe_sizes.append(len(trainer.param_estimate.probe))
        return result

    spy(trainer.param_estimate, "estimate", record)
    assert isinstance(trainer.param_estimate, ParamEstimate)
    trainer.train()
    assert probe_sizes == [0, 2, 4]
    measured, unweighted = (
        logged(trainer, "entropy_flow/measured_delta"),
        logged(trainer, "opefo/step_change_unweighted"),
    )
    predicted, reached = logged(trainer, "entropy_flow/predicted_delta"), logged(trainer, "opefo/step_change")
    for step in range(3):  # measured: 1.1e-2, 1.3e-3, 2.4e-2 of GRPO's first order
        assert abs(reached[step]) <= 1e-6 * abs(unweighted[step])  # the root search's residual
        # From the float32 gradient the optimizer really applied: Adam's first steps divide by |g_i|, so its rounding
        # shows (4e-8 and 5e-6 of GRPO's under the two kernel settings; benchmarks/step_balance.py: up to 3.5e-4).
        assert abs(predicted[step]) <= 1e-3 * abs(unweighted[step])
        assert abs(measured[step]) <= 0.1 * abs(unweighted[step]), step


def test_a_balance_of_the_task_tokens_entropy_holds_it_and_the_audit_measures_it(
    warm_model_path, tiny_dataset, length_reward, tmp_path
):
    """entropy_flow_entropy='task_tokens' (the digits): the step balance zeroes the first-order change of the mean
    entropy of the policy renormalised over the digits; the audit re-scores it after the real AdamW step (second
    order, far below GRPO's first-order change of it); and that entropy is what a plain full softmax of the model
    gives over the digits, while TRL's loss keeps reading the whole vocabulary's."""
    digits = list(range(18, 28))
    args = make_config(
        tmp_path, max_steps=3, learning_rate=1e-5, optim="adamw_torch", max_grad_norm=1e9, entropy_flow_audit_steps=1,
        entropy_flow_task_tokens=digits, entropy_flow_entropy="task_tokens", **STEP_BALANCE,
    )  # fmt: skip
    trainer = make_trainer(warm_model_path, tiny_dataset, length_reward, args)
    rollouts = []
    spy(trainer.param_estimate, "estimate", lambda original, items: rollouts.append(items) or original(items))
    trainer.train()
    measured, unweighted = (
        logged(trainer, "entropy_flow/measured_delta"),
        logged(trainer, "opefo/step_change_unweighted"),
    )
    reached = logged(trainer, "opefo/step_change")
    assert max(logged(trainer, "entropy_flow/param_check_error")) < 1e-4
    for step in range(3):
        assert abs(reached[step]) <= 1e-6 * abs(unweighted[step])
        assert abs(measured[step]) <= 0.1 * abs(unweighted[step]), (step, measured, unweighted)

    batch = rollouts[-1][0].batch
    scores = trainer.scorer.score_full_precision(batch)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    length = batch["completion_ids"].shape[1]
    with torch.no_grad():
        logits = trainer.model(input_ids=ids, attention_mask=mask).logits[:, -length - 1 : -1].double()
    logits = logits / trainer.temperature
    q = torch.log_softmax(logits[..., digits], -1)
    logp = torch.log_softmax(logits, -1)
    in_loss = batch["completion_mask"].bool()
    torch.testing.assert_close(
        scores.token_set_entropies.double()[in_loss], -(q.exp() * q).sum(-1)[in_loss], rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(
        scores.entropies.double()[in_loss], -(logp.exp() * logp).sum(-1)[in_loss], rtol=1e-5, atol=1e-5
    )


def test_an_entropy_setpoint_moves_the_probe_s_entropy_by_the_change_it_asks_for(
    warm_model_path, tiny_dataset, length_reward, tmp_path
):
    """opefo_entropy_target far above the entropy with a small rate asks each step for a rise of rate * gap (~1e-3,
    a few tenths of what GRPO's step changes); the audit's re-scored change of the probe tracks it to second order."""
    args = make_config(
        tmp_path, max_steps=3, learning_rate=1e-5, optim="adamw_torch", max_grad_norm=1e9, entropy_flow_audit_steps=1,
        entropy_flow_probe_rollouts=2, opefo_entropy_target=10.0, opefo_entropy_target_rate=1e-4, **STEP_BALANCE,
    )  # fmt: skip
    trainer = make_trainer(warm_model_path, tiny_dataset, length_reward, args)
    trainer.train()
    target, reached = logged(trainer, "opefo/step_target"), logged(trainer, "opefo/step_change")
    measured, unweighted = (
        logged(trainer, "entropy_flow/measured_delta"),
        logged(trainer, "opefo/step_change_unweighted"),
    )
    assert len(target) == 3 and all(t > 0 for t in target)
    for step in range(3):  # measured: 2.9%, 0.35%, 0.23% off the target
        assert abs(reached[step] - target[step]) <= 1e-5 * abs(unweighted[step] - target[step])  # the solver's
        assert measured[step] == pytest.approx(target[step], rel=0.1), step
