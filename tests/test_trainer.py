"""OPEFOTrainer runs wherever GRPOTrainer runs, logs the entropy-flow metrics, and equals GRPO at lambda = 0."""

import json
import os

import pytest
import torch

from opefo_trl import OPEFOConfig, OPEFOTrainer
from opefo_trl.entropy_flow import entropy_flow, flow_stats

FLOW_METRICS = [
    "entropy_flow/lambda",
    "entropy_flow/increase",
    "entropy_flow/decrease",
    "entropy_flow/net",
    "entropy_flow/increase_token_frac",
    "entropy_flow/decrease_token_frac",
]


def length_reward(completions, **kwargs):
    """Deterministic and varied within a group, so advantages are non-zero."""
    return [float(len(c[0]["content"]) % 3) for c in completions]


def base_settings(tmp_path, **overrides):
    settings = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=12,
        max_steps=2,
        logging_steps=1,
        learning_rate=1e-3,
        bf16=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    settings.update(overrides)
    return settings


def make_config(tmp_path, **overrides):
    return OPEFOConfig(**base_settings(tmp_path, **overrides))


def logged(trainer, name):
    return [entry[name] for entry in trainer.state.log_history if name in entry]


def train(tiny_model_path, tiny_dataset, args, **kwargs):
    trainer = OPEFOTrainer(
        model=tiny_model_path, reward_funcs=length_reward, args=args, train_dataset=tiny_dataset, **kwargs
    )
    trainer.train()
    return trainer


@pytest.mark.parametrize(
    "overrides",
    [
        dict(loss_type="dapo"),
        dict(loss_type="grpo"),
        dict(loss_type="bnpo"),
        dict(loss_type="dr_grpo"),
        dict(beta=0.1),
        dict(gradient_accumulation_steps=2, per_device_train_batch_size=4),
        dict(entropy_flow_estimate="full", gradient_accumulation_steps=2, per_device_train_batch_size=4),
    ],
    ids=["dapo", "grpo", "bnpo", "dr_grpo", "beta", "grad_accum", "full_estimate"],
)
def test_opefo_trains_in_grpo_configurations_and_logs_flow_metrics(tiny_model_path, tiny_dataset, tmp_path, overrides):
    trainer = train(tiny_model_path, tiny_dataset, make_config(tmp_path, **overrides))
    for name in FLOW_METRICS + ["opefo/weighted_net", "loss", "entropy", "reward"]:
        assert len(logged(trainer, name)) == 2, f"{name} missing from log_history"
    for lam, inc, dec, net in zip(*(logged(trainer, n) for n in FLOW_METRICS[:4]), strict=True):
        assert -1.0 <= lam <= 1.0 and inc >= 0 and dec >= 0
        assert lam == pytest.approx((dec - inc) / (dec + inc))
        assert net == pytest.approx(inc - dec)
    for inc, weighted_net in zip(
        logged(trainer, "entropy_flow/increase"), logged(trainer, "opefo/weighted_net"), strict=True
    ):
        assert abs(weighted_net) <= 1e-5 * inc
    if "beta" in overrides:
        assert len(logged(trainer, "kl")) == 2


@pytest.mark.parametrize(
    "overrides",
    [
        dict(entropy_flow_estimate="full", gradient_accumulation_steps=2, per_device_train_batch_size=4),
        dict(beta=0.1, num_iterations=2, allow_off_policy=True),  # reference = adapter disabled, after TRL's pass
    ],
    ids=["full_estimate", "beta_off_policy"],
)
def test_opefo_trains_with_lora(tiny_model_path, tiny_dataset, tmp_path, overrides):
    from peft import LoraConfig

    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    args = make_config(tmp_path, **overrides)
    trainer = train(tiny_model_path, tiny_dataset, args, peft_config=peft_config)
    assert len(logged(trainer, "entropy_flow/lambda")) == (1 if "num_iterations" in overrides else 2)
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora" in n for n in trainable)


def _parameters_after_one_step(trainer_class, tiny_model_path, tiny_dataset, args):
    from transformers import set_seed

    set_seed(0)
    trainer = trainer_class(model=tiny_model_path, reward_funcs=length_reward, args=args, train_dataset=tiny_dataset)
    trainer.train()
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("accumulation", [1, 2])
def test_lambda_zero_takes_the_same_step_as_grpo_and_lambda_star_does_not(
    tiny_model_path, tiny_dataset, tmp_path, accumulation
):
    from trl import GRPOConfig, GRPOTrainer

    common = dict(max_steps=1, gradient_accumulation_steps=accumulation, per_device_train_batch_size=8 // accumulation)
    grpo_args = GRPOConfig(**base_settings(tmp_path, **common))
    reference = _parameters_after_one_step(GRPOTrainer, tiny_model_path, tiny_dataset, grpo_args)
    zero = _parameters_after_one_step(
        OPEFOTrainer, tiny_model_path, tiny_dataset, make_config(tmp_path, opefo_lambda=0.0, **common)
    )
    balanced = _parameters_after_one_step(OPEFOTrainer, tiny_model_path, tiny_dataset, make_config(tmp_path, **common))
    for name, value in reference.items():
        torch.testing.assert_close(zero[name], value, rtol=0, atol=1e-7, msg=f"{name} differs at lambda=0")
    assert any(not torch.allclose(balanced[n], reference[n], atol=1e-7) for n in reference)


@pytest.mark.parametrize(
    "method,overrides,expected",
    [
        ("grpo", {}, FLOW_METRICS),
        ("grpo", dict(entropy_coef=1e-3), FLOW_METRICS + ["entropy_coef"]),
        ("par", {}, ["par/coef", "par/entropy"] + FLOW_METRICS),
        ("par", dict(par_coef=0.5), ["par/coef"]),
        ("clip_cov", dict(clip_cov_lb=-1e9, clip_cov_ub=1e9), ["clip_cov/dropped_frac"] + FLOW_METRICS),
        ("kl_cov", dict(num_iterations=2), ["kl_cov/penalised_frac"] + FLOW_METRICS),
        ("opefo", dict(opefo_sides="decrease_only"), FLOW_METRICS + ["opefo/lambda_applied"]),
    ],
)
def test_every_method_trains_and_logs_its_metrics(tiny_model_path, tiny_dataset, tmp_path, method, overrides, expected):
    trainer = train(tiny_model_path, tiny_dataset, make_config(tmp_path, method=method, **overrides))
    for name in expected:
        values = logged(trainer, name)
        assert values, f"{name} missing from log_history of method={method}"
    if method == "clip_cov":
        assert all(0 < v < 0.05 for v in logged(trainer, "clip_cov/dropped_frac"))


def test_diagnostics_disabled_log_no_flow(tiny_model_path, tiny_dataset, tmp_path):
    trainer = train(tiny_model_path, tiny_dataset, make_config(tmp_path, method="grpo", entropy_flow_diagnostics=False))
    assert not logged(trainer, "entropy_flow/lambda")


def test_grpo_diagnostics_equal_the_maths_on_the_same_batch(tiny_model_path, tiny_dataset, tmp_path):
    """Recompute log pi and H with a plain full-softmax forward of the pre-step model, then the flow by hand."""
    seen = []

    class Recording(OPEFOTrainer):
        def _compute_loss(self, model, inputs):
            core = self.accelerator.unwrap_model(self.model)
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
            attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
            with torch.no_grad():
                logits = core(input_ids=ids, attention_mask=attention).logits.float() / self.temperature
            t = inputs["completion_ids"].size(1)
            logp = torch.log_softmax(logits[:, -t - 1 : -1], -1)
            seen.append(
                dict(
                    logps=logp.gather(-1, inputs["completion_ids"][..., None])[..., 0],
                    entropies=-(logp.exp() * logp).sum(-1),
                    advantages=inputs["advantages"].clone(),
                    mask=inputs["completion_mask"].clone(),
                )
            )
            return super()._compute_loss(model, inputs)

    args = make_config(tmp_path, method="grpo", max_steps=1)
    trainer = Recording(model=tiny_model_path, reward_funcs=length_reward, args=args, train_dataset=tiny_dataset)
    trainer.train()
    (batch,) = seen
    stats = flow_stats(entropy_flow(batch["logps"], batch["entropies"], batch["advantages"]), batch["mask"])
    expected = stats.metrics()
    for name in FLOW_METRICS:
        assert logged(trainer, name)[0] == pytest.approx(expected[name], rel=1e-3, abs=1e-6), name


def test_par_coefficient_survives_resume_from_checkpoint(tiny_model_path, tiny_dataset, tmp_path):
    args = make_config(tmp_path, method="par", par_coef_init=0.5, save_strategy="steps", save_steps=2, max_steps=2)
    first = train(tiny_model_path, tiny_dataset, args)
    checkpoint = os.path.join(args.output_dir, "checkpoint-2")
    with open(os.path.join(checkpoint, "opefo_method_state.json")) as f:
        saved = json.load(f)
    assert saved == {"method": "par", "state": {"coef": first.token_method.coef, "adaptive": True}}
    assert first.token_method.coef != 0.5  # the controller moved, so a reset would be visible

    # Resume and take one more step: the coefficient it applies is the one the first run handed on.
    more = make_config(tmp_path, method="par", par_coef_init=0.5, save_strategy="no", max_steps=3)
    resumed = OPEFOTrainer(model=tiny_model_path, reward_funcs=length_reward, args=more, train_dataset=tiny_dataset)
    assert resumed.token_method.coef == 0.5
    resumed.train(resume_from_checkpoint=checkpoint)
    step3 = [entry for entry in resumed.state.log_history if entry.get("step") == 3 and "par/coef" in entry]
    assert step3 and step3[0]["par/coef"] == pytest.approx(first.token_method.coef)

    other = make_config(tmp_path, method="grpo", save_strategy="steps", save_steps=2, max_steps=2)
    mismatched = OPEFOTrainer(model=tiny_model_path, reward_funcs=length_reward, args=other, train_dataset=tiny_dataset)
    with pytest.raises(ValueError, match="trained with method='par'"):
        mismatched.train(resume_from_checkpoint=checkpoint)


def test_a_grpo_config_is_accepted_as_a_drop_in(tiny_model_path, tiny_dataset, tmp_path):
    from trl import GRPOConfig

    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        max_steps=1,
        bf16=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
    )
    trainer = OPEFOTrainer(model=tiny_model_path, reward_funcs=length_reward, args=args, train_dataset=tiny_dataset)
    assert isinstance(trainer.args, OPEFOConfig) and trainer.args.method == "opefo"
    assert trainer.args.max_completion_length == 8
    trainer.train()
    assert logged(trainer, "entropy_flow/lambda")


def _scoring_passes(trainer_class, args, tiny_model_path, tiny_dataset):
    """Backbone forwards other than single-token decoding (prefill + scoring), over the whole run."""
    trainer = trainer_class(model=tiny_model_path, reward_funcs=length_reward, args=args, train_dataset=tiny_dataset)
    count = [0]

    def pre_hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        count[0] += int(ids is None or ids.shape[-1] > 1)

    trainer.accelerator.unwrap_model(trainer.model).base_model.register_forward_pre_hook(pre_hook, with_kwargs=True)
    trainer.train()
    return count[0]


@pytest.mark.parametrize(
    "overrides,extra_calls",
    [
        (dict(), 0),  # one micro-batch: the training forward gives the statistics
        (dict(num_iterations=2, allow_off_policy=True), 0),  # TRL's old-log-prob pass is reused
        # one no-grad pass over the rollout batch, in micro-batch-sized chunks (2 backbone calls)
        (dict(gradient_accumulation_steps=2, per_device_train_batch_size=4), 2),
    ],
    ids=["single_micro_batch", "trl_scoring_pass_reused", "accumulation"],
)
def test_opefo_adds_a_forward_pass_only_when_trl_has_none_to_share(
    tiny_model_path, tiny_dataset, tmp_path, overrides, extra_calls
):
    from trl import GRPOConfig, GRPOTrainer

    settings = base_settings(tmp_path, **{k: v for k, v in overrides.items() if k != "allow_off_policy"})
    grpo = _scoring_passes(GRPOTrainer, GRPOConfig(**settings), tiny_model_path, tiny_dataset)
    opefo = _scoring_passes(OPEFOTrainer, make_config(tmp_path, **overrides), tiny_model_path, tiny_dataset)
    rollouts = 2 if overrides.get("num_iterations") is None else 1  # max_steps=2
    assert opefo - grpo == extra_calls * rollouts


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),  # weights from the training forward
        dict(gradient_accumulation_steps=2, per_device_train_batch_size=4),  # own scoring pass
        dict(gradient_accumulation_steps=2, per_device_train_batch_size=4, num_iterations=2, allow_off_policy=True),
        dict(  # one micro-batch per rollout but the buffered batch is reused: weights must live in the buffer
            gradient_accumulation_steps=2,
            per_device_train_batch_size=4,
            steps_per_generation=1,
            num_iterations=2,
            allow_off_policy=True,
        ),
    ],
    ids=["training_forward", "scoring_pass", "trl_scoring_pass", "reused_single_micro_batch"],
)
def test_every_micro_batch_gets_the_weights_exactly_once(tiny_model_path, tiny_dataset, tmp_path, overrides):
    """Per row, TRL must see advantages A * w with w in {1 + lambda*, 1 - lambda*, 1}: never A alone, never A * w^2."""
    seen = []

    class Spy(OPEFOTrainer):
        def _apply_token_method(self, logps, entropies, vocab):
            super()._apply_token_method(logps, entropies, vocab)
            seen.append((self._loss_inputs["advantages"].clone(), self._loss_mask(self._loss_inputs), lambdas[-1]))

    lambdas = []
    trainer = Spy(
        model=tiny_model_path,
        reward_funcs=length_reward,
        args=make_config(tmp_path, max_steps=4, **overrides),
        train_dataset=tiny_dataset,
    )
    rollout_weights = trainer.token_method.rollout_weights

    def recording(batch, reduce_sum):
        weights = rollout_weights(batch, reduce_sum)
        lambdas.append(trainer.token_method.metrics["opefo/lambda_applied"])
        return weights

    trainer.token_method.rollout_weights = recording
    trainer.train()
    assert len(seen) == 4 * trainer.args.gradient_accumulation_steps
    for advantages, mask, lam in seen:
        assert advantages.dim() == 2, "the advantages reaching TRL must be per-token"
        weighted_rows, active_rows = 0, 0
        factors = torch.tensor([1 + lam, 1 - lam, 1.0], dtype=torch.float64)
        for row, row_mask in zip(advantages.double(), mask.bool(), strict=True):
            values = row[row_mask]
            if values.numel() == 0 or values.abs().max() == 0:
                continue
            explained = [
                base
                for base in values[0] / factors
                if all(torch.isclose(v / base, factors, rtol=1e-5, atol=0).any() for v in values)
            ]
            assert explained, f"row advantages {values.unique().tolist()} are not A x (1 +/- {lam}, 1)"
            weighted_rows += int(values.unique().numel() > 1)
            active_rows += 1
        assert weighted_rows > 0 or active_rows == 0 or lam == 0, "a micro-batch reached the loss unweighted"


def test_clip_cov_trains_off_policy_with_default_epsilon_high(tiny_model_path, tiny_dataset, tmp_path):
    trainer = train(tiny_model_path, tiny_dataset, make_config(tmp_path, method="clip_cov", num_iterations=2))
    assert logged(trainer, "clip_cov/dropped_frac")


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"])
def test_extra_loss_terms_are_normalised_exactly_like_trl_policy_loss(
    tiny_model_path, tiny_dataset, tmp_path, loss_type
):
    """With A = -1 and ratio 1, TRL's policy loss is its own aggregation of a per-token 1: ours must match it."""
    from trl import GRPOTrainer

    args = make_config(
        tmp_path, method="kl_cov", loss_type=loss_type, gradient_accumulation_steps=2, per_device_train_batch_size=4
    )
    trainer = OPEFOTrainer(model=tiny_model_path, reward_funcs=length_reward, args=args, train_dataset=tiny_dataset)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    inputs["advantages"] = -torch.ones_like(inputs["advantages"])
    with torch.no_grad():
        trl_loss = GRPOTrainer._compute_loss(trainer, trainer.model, inputs)
    mask = trainer._loss_mask(inputs)
    ours = trainer._aggregate_like_policy_loss(torch.ones_like(mask, dtype=torch.float32), mask, inputs)
    assert ours.item() == pytest.approx(trl_loss.item(), rel=1e-6)
