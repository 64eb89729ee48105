"""OPEFOTrainer runs wherever GRPOTrainer runs, balances the flow of the update TRL really applies, logs the
entropy-flow metrics, keeps the user's config, and equals GRPO at lambda = 0."""

import json
import os
import warnings

import pytest
import torch
from trainer_setup import base_settings, first_rollout, logged, make_config, make_trainer, spy

from opefo_trl import OPEFOConfig, OPEFOTrainer
from opefo_trl.maths.entropy_flow import entropy_flow, flow_per_unit_advantage, flow_stats, token_weights
from opefo_trl.trainer.batch_state import STATE_KEY
from opefo_trl.trainer.loss_mirror import LOSS_TYPES

FLOW_METRICS = [
    "entropy_flow/lambda",
    "entropy_flow/increase",
    "entropy_flow/decrease",
    "entropy_flow/net",
    "entropy_flow/increase_token_frac",
    "entropy_flow/decrease_token_frac",
]
OPEFO_METRICS = ["opefo/weighted_net"]  # and opefo/lambda_applied where the lambda applied is not lambda*


@pytest.fixture
def train(tiny_model_path, tiny_dataset, length_reward):
    def run(args, trainer_class=OPEFOTrainer, setup=None, **kwargs):
        trainer = make_trainer(tiny_model_path, tiny_dataset, length_reward, args, trainer_class, **kwargs)
        if setup is not None:
            setup(trainer)
        trainer.train()
        return trainer

    return run


def _assert_balanced(trainer):
    """lambda* is (N - P) / (N + P) of the logged sums and the reweighted flow is zero, on every step."""
    for lam, inc, dec, net in zip(*(logged(trainer, n) for n in FLOW_METRICS[:4]), strict=True):
        assert -1.0 <= lam <= 1.0 and inc >= 0 and dec >= 0
        assert lam == pytest.approx((dec - inc) / (dec + inc))
        assert net == pytest.approx(inc - dec)
    for inc, dec, weighted_net in zip(
        logged(trainer, "entropy_flow/increase"),
        logged(trainer, "entropy_flow/decrease"),
        logged(trainer, "opefo/weighted_net"),
        strict=True,
    ):
        assert abs(weighted_net) <= 1e-5 * (inc + dec)


OUR_PREFIXES = ("entropy_flow", "opefo", "par", "clip_cov", "kl_cov", "steer", "stare", "ce_gppo")
METRICS_DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "metrics.md")


def _assert_documented(trainer):
    """Every key of this library's that the run logged is a row of docs/metrics.md's table."""
    with open(METRICS_DOC, encoding="utf-8") as f:
        table = f.read()
    ours = {name for entry in trainer.state.log_history for name in entry if name.split("/")[0] in OUR_PREFIXES}
    assert ours and not {name for name in ours if f"| `{name}`" not in table and f", `{name}`" not in table}


def _assert_one_name_per_value(trainer):
    """No key of this library's logs the same per-step values as another logged key (TRL's or ours): one value, one
    name. Series constant over the steps (e.g. 1.0, 1.0) can agree by chance and are skipped."""
    series = {name: logged(trainer, name) for entry in trainer.state.log_history for name in entry}
    for name, values in series.items():
        if name.split("/")[0] not in ("entropy_flow", "opefo") or len(set(values)) == 1:
            continue
        for other, others in series.items():
            if other != name and len(others) == len(values):
                assert others != pytest.approx(values, rel=1e-6, abs=0), f"{name} and {other} log the same values"


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
        dict(entropy_flow_estimate="param", gradient_accumulation_steps=2, per_device_train_batch_size=4),
    ],
    ids=["dapo", "grpo", "bnpo", "dr_grpo", "beta", "grad_accum", "full_estimate", "param_estimate"],
)
def test_opefo_trains_in_grpo_configurations_and_logs_flow_metrics(train, tmp_path, overrides):
    trainer = train(make_config(tmp_path, **overrides))
    for name in FLOW_METRICS + OPEFO_METRICS + ["loss", "entropy", "reward"]:
        assert len(logged(trainer, name)) == 2, f"{name} missing from log_history"
    assert not logged(trainer, "opefo/lambda_applied")  # the lambda* entropy_flow/lambda logs
    _assert_balanced(trainer)
    _assert_one_name_per_value(trainer)
    _assert_documented(trainer)
    if "beta" in overrides:
        assert len(logged(trainer, "kl")) == 2
    if overrides.get("entropy_flow_estimate") == "param":
        assert all(error < 0.05 for error in logged(trainer, "entropy_flow/param_check_error"))


@pytest.mark.parametrize(
    "overrides",
    [
        dict(entropy_flow_estimate="full", gradient_accumulation_steps=2, per_device_train_batch_size=4),
        dict(beta=0.1, num_iterations=2, allow_off_policy=True),  # reference = adapter disabled, after TRL's pass
        dict(entropy_flow_estimate="param"),
    ],
    ids=["full_estimate", "beta_off_policy", "param_estimate"],
)
def test_opefo_trains_with_lora(train, tmp_path, overrides):
    from peft import LoraConfig

    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    frozen = {}

    def record_frozen(trainer):
        def record(estimate, items):
            model = trainer.accelerator.unwrap_model(trainer.model)
            frozen.update({n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad})
            return estimate(items)

        if trainer.param_estimate is not None:
            spy(trainer.param_estimate, "estimate", record)

    trainer = train(make_config(tmp_path, **overrides), setup=record_frozen, peft_config=peft_config)
    # Every optimizer step logs the flow, also the second update on the same rollout batch (num_iterations=2).
    assert len(logged(trainer, "entropy_flow/lambda")) == len(logged(trainer, "opefo/weighted_net")) == 2
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora" in n for n in trainable)
    if overrides.get("entropy_flow_estimate") == "param":
        # Only the adapters enter the parameter-space flow: the frozen weights are never perturbed.
        assert frozen and not any("lora" in n for n in frozen)
        after = dict(trainer.model.named_parameters())
        assert all(torch.equal(after[n].detach(), value) for n, value in frozen.items())


@pytest.mark.parametrize("cast", [True, False])
def test_lora_on_a_tied_bf16_model_scores_with_the_float32_head_it_asks_for(
    tiny_model_path, tiny_dataset, length_reward, tmp_path, cast
):
    """TRL 1.16 raises an AttributeError casting a PEFT model's tied head; the trainer casts it on the base model, and
    the fused head then gives the log-probs of float32 logits of the same hidden states (bf16 logits when not asked)."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16)
    assert model.config.tie_word_embeddings
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    args = make_config(tmp_path, cast_lm_head_to_fp32=cast)
    trainer = make_trainer(model, tiny_dataset, length_reward, args, peft_config=peft_config)
    assert trainer.args.cast_lm_head_to_fp32 is cast
    core = trainer.scorer.core()
    assert core.lm_head.weight.dtype == (torch.float32 if cast else torch.bfloat16)
    input_ids = torch.randint(0, core.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    assert core.get_input_embeddings()(input_ids).dtype == torch.bfloat16  # the backbone still runs in bf16
    with torch.no_grad():
        hidden = core.model(input_ids=input_ids).last_hidden_state[:, :-1]
        exact = torch.log_softmax(hidden.double() @ core.lm_head.weight.double().T, dim=-1)
        exact = exact.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
        fused = core(input_ids=input_ids, labels=input_ids, fused_lm_head=True).log_probs.double()
    error = (fused - exact).abs().max().item()
    # float32 logits: ~1e-6 of |logit| ~ 1; bf16 logits: 2^-8 relative rounding, ~1e-3 here
    assert error < 1e-5 if cast else error > 1e-4


def _parameters_after_one_step(train, args, trainer_class):
    from transformers import set_seed

    set_seed(0)
    trainer = train(args, trainer_class)
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


#: What the two trainers log differently by nature: wall-clock times.
TIMINGS = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")


@pytest.mark.parametrize("loss_type, level", [(loss, level) for loss in LOSS_TYPES for level in ("token", "sequence")])
def test_method_grpo_trains_bit_for_bit_what_grpo_trainer_trains(train, tmp_path, loss_type, level):
    """Issue 53: under luspo the parameters after one step differed from GRPOTrainer's by 2.9e-5 relative (TRL was
    handed (B, T) advantages where it computes with (B,) ones, so its sums ran in another order). Every loss type
    and importance-sampling level, two micro-batches, one step: the same parameters and the same logged metrics,
    bit for bit."""
    from transformers import set_seed
    from trl import GRPOConfig, GRPOTrainer

    common = dict(
        max_steps=1,
        gradient_accumulation_steps=2,
        per_device_train_batch_size=4,
        loss_type=loss_type,
        importance_sampling_level=level,
    )

    def one_step(args, trainer_class):
        set_seed(0)
        trainer = train(args, trainer_class)
        return dict(trainer.model.named_parameters()), trainer.state.log_history

    theirs, their_logs = one_step(GRPOConfig(**base_settings(tmp_path, **common)), GRPOTrainer)
    ours, our_logs = one_step(make_config(tmp_path, method="grpo", **common), OPEFOTrainer)
    assert all(torch.equal(ours[name], value) for name, value in theirs.items())
    for their_entry, our_entry in zip(their_logs, our_logs, strict=True):  # ours also has the entropy flow's
        assert {k: v for k, v in their_entry.items() if k not in TIMINGS} == {
            k: our_entry.get(k) for k in their_entry if k not in TIMINGS
        }


@pytest.mark.numerics
@pytest.mark.parametrize("accumulation", [1, 2])
def test_lambda_zero_takes_the_same_step_as_grpo_and_lambda_star_does_not(train, tmp_path, accumulation):
    from trl import GRPOConfig, GRPOTrainer

    common = dict(max_steps=1, gradient_accumulation_steps=accumulation, per_device_train_batch_size=8 // accumulation)
    reference = _parameters_after_one_step(train, GRPOConfig(**base_settings(tmp_path, **common)), GRPOTrainer)
    zero = _parameters_after_one_step(train, make_config(tmp_path, opefo_lambda=0.0, **common), OPEFOTrainer)
    balanced = _parameters_after_one_step(train, make_config(tmp_path, **common), OPEFOTrainer)
    for name, value in reference.items():
        torch.testing.assert_close(zero[name], value, rtol=0, atol=1e-7, msg=f"{name} differs at lambda=0")
    assert any(not torch.allclose(balanced[n], reference[n], atol=1e-7) for n in reference)


@pytest.mark.parametrize(
    "method,overrides,expected",
    [
        ("grpo", {}, FLOW_METRICS),
        ("grpo", dict(entropy_coef=1e-3), FLOW_METRICS + ["entropy_coef"]),
        ("par", {}, ["par/coef", "par/entropy"] + FLOW_METRICS),
        ("clip_cov", dict(clip_cov_lb=-1e9, clip_cov_ub=1e9), ["clip_cov/dropped_frac"] + FLOW_METRICS),
        ("kl_cov", dict(num_iterations=2), ["kl_cov/penalised_frac"] + FLOW_METRICS),
        ("opefo", dict(opefo_sides="decrease_only"), FLOW_METRICS + OPEFO_METRICS),
    ],
)
def test_every_method_trains_and_logs_its_metrics_every_step(train, tmp_path, method, overrides, expected):
    trainer = train(make_config(tmp_path, method=method, **overrides))
    for name in expected:
        assert len(logged(trainer, name)) == 2, f"{name} not logged on every step of method={method}"
    _assert_documented(trainer)
    if method == "clip_cov":
        assert all(0 < v < 0.05 for v in logged(trainer, "clip_cov/dropped_frac"))


def test_a_constant_par_coefficient_weights_every_positive_token_by_it(train, tmp_path):
    seen = []

    def record(apply, call, logps, entropies, vocab):
        original = call.inputs["advantages"].clone()
        apply(call, logps, entropies, vocab)
        seen.append((original, call.inputs["advantages"]))

    trainer = train(
        make_config(tmp_path, method="par", par_coef=0.5), setup=lambda t: spy(t.micro_batches, "apply", record)
    )
    assert logged(trainer, "par/coef") == [0.5, 0.5]
    assert len(seen) == 2
    for original, applied in seen:
        expected = torch.where(original > 0, 0.5 * original, original)[:, None].expand_as(applied)
        torch.testing.assert_close(applied, expected)
        assert (original > 0).any() and (original < 0).any()


@pytest.mark.parametrize("method", ["grpo", "opefo"])
def test_diagnostics_switched_off_log_no_entropy_flow_metrics(train, tmp_path, method):
    trainer = train(make_config(tmp_path, method=method, entropy_flow_diagnostics=False))
    assert not any(name.startswith("entropy_flow/") for entry in trainer.state.log_history for name in entry)
    if method == "opefo":  # the lambda OPEFO applies keeps its own prefix
        assert all(len(logged(trainer, name)) == 2 for name in OPEFO_METRICS + ["opefo/lambda_applied"])


@pytest.mark.numerics
def test_grpo_diagnostics_equal_the_maths_on_the_same_batch(tiny_model_path, tiny_dataset, length_reward, tmp_path):
    """Recompute log pi and H with a plain full-softmax forward of the pre-step model, then the flow by hand."""
    seen = []

    def record(loss_call, inputs):  # the micro-batch as TRL's loss receives it, before the step
        core = trainer.accelerator.unwrap_model(trainer.model)
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        with torch.no_grad():
            logits = core(input_ids=ids, attention_mask=attention).logits.float() / trainer.temperature
        t = inputs["completion_ids"].size(1)
        logp = torch.log_softmax(logits[:, -t - 1 : -1], -1)
        seen.append(
            dict(
                logps=logp.gather(-1, inputs["completion_ids"][..., None])[..., 0],
                entropies=-(logp.exp() * logp).sum(-1),
                advantages=inputs["advantages"].clone(),
                mask=inputs["completion_mask"].clone(),
                tokens=inputs["num_items_in_batch"].clone(),
                ids=inputs["completion_ids"].clone(),
            )
        )
        return loss_call(inputs)

    digits = list(range(18, 28))  # the tiny tokenizer's "0".."9"
    args = make_config(tmp_path, method="grpo", max_steps=1, entropy_flow_task_tokens=digits)
    trainer = make_trainer(tiny_model_path, tiny_dataset, length_reward, args)
    spy(trainer.micro_batches, "loss_call", record)
    trainer.train()
    (batch,) = seen
    # dapo: TRL divides the summed token losses by the rollout batch's token count.
    assert batch["tokens"].item() == batch["mask"].sum().item()
    factor = batch["mask"] / batch["tokens"]
    stats = flow_stats(entropy_flow(batch["logps"], batch["entropies"], batch["advantages"]), factor)
    expected = stats.metrics()
    for name in FLOW_METRICS:
        assert logged(trainer, name)[0] == pytest.approx(expected[name], rel=1e-3, abs=1e-9), name
    # entropy_flow_task_tokens: the shares of P, N and the tokens sampled outside the digits.
    flow = entropy_flow(batch["logps"], batch["entropies"], batch["advantages"]).double() * factor
    off_task = ~torch.isin(batch["ids"], torch.tensor(digits)) & (batch["mask"] > 0)
    assert 0 < off_task.sum() < batch["mask"].sum()
    for side, chosen in (("increase", flow > 0), ("decrease", flow < 0)):
        want = float(flow[off_task & chosen].abs().sum() / flow[chosen].abs().sum())
        assert logged(trainer, f"entropy_flow/off_task_{side}_share")[0] == pytest.approx(want, rel=1e-3, abs=1e-9)
    want = float(off_task.sum() / batch["mask"].sum())
    assert logged(trainer, "entropy_flow/off_task_token_frac")[0] == pytest.approx(want)


@pytest.mark.numerics
def test_lambda_star_balances_the_flow_of_the_tokens_trl_keeps_under_an_entropy_mask(train, tmp_path):
    """top_entropy_quantile < 1: TRL trains on the high-entropy tokens only; lambda* must balance their flow."""
    from trl import GRPOTrainer

    seen, masks = [], []

    def setup(trainer):
        def recording(entropies, mask, threshold):  # TRL's own mask, computed in its loss
            masks.append(GRPOTrainer.get_high_entropy_mask(trainer, entropies, mask, threshold))
            return masks[-1]

        def finish(original, call, loss):  # the last mask computed before the loss is finished is TRL's own
            seen.append(dict(entropy_mask=masks[-1], inputs=call.inputs))
            return original(call, loss)

        trainer.get_high_entropy_mask = recording
        spy(trainer.micro_batches, "finish", finish)

    args = make_config(
        tmp_path, top_entropy_quantile=0.2, gradient_accumulation_steps=2, per_device_train_batch_size=4, max_steps=3
    )
    trainer = train(args, setup=setup)
    nets, grosses = {}, {}
    for step, record in enumerate(seen):
        inputs, keep = record["inputs"], record["entropy_mask"].float()
        assert keep.sum() < inputs["completion_mask"].sum(), "the entropy mask should drop tokens"
        unit, applied = inputs[STATE_KEY].unit_flow, inputs["advantages"]
        kept_flow = keep * inputs["completion_mask"] * applied * unit / inputs["num_items_in_batch"]
        nets[step // 2] = nets.get(step // 2, 0.0) + kept_flow.double().sum().item()
        grosses[step // 2] = grosses.get(step // 2, 0.0) + kept_flow.double().abs().sum().item()
    assert len(nets) == 3
    for optimizer_step, net in nets.items():
        assert abs(net) <= 1e-5 * grosses[optimizer_step], (optimizer_step, net, grosses[optimizer_step])
    assert any(abs(x) > 0 for x in logged(trainer, "entropy_flow/lambda"))


@pytest.fixture
def emulated_vllm(monkeypatch):
    """TRL's vLLM outputs without vLLM: after the rollout is generated on CPU, attach a sequence-level
    importance-sampling ratio (some sequences masked to 0, as vllm_importance_sampling_mode='sequence_mask' does)
    and switch the trainer's vLLM correction on, so that TRL's loss multiplies it in."""
    from trl import GRPOTrainer

    generate = GRPOTrainer._generate_and_score_completions
    ratios = []

    def with_importance_weights(self, inputs):
        self.use_vllm = False  # generate with transformers
        try:
            output = generate(self, inputs)
        finally:
            self.use_vllm = True
        gen = torch.Generator().manual_seed(len(ratios))
        ratio = 0.5 + torch.rand(output["completion_ids"].size(0), 1, generator=gen)
        ratio[::3] = 0.0  # every third sequence is off the trust region: zero weight
        output["importance_sampling_ratio"] = ratio
        ratios.append(ratio)
        return output

    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", with_importance_weights)
    return ratios


@pytest.mark.numerics
@pytest.mark.parametrize("accumulation", [1, 2])
def test_lambda_star_balances_the_importance_weighted_flow_trl_applies(
    tiny_model_path, tiny_dataset, length_reward, tmp_path, emulated_vllm, accumulation
):
    rollouts = []

    def record(apply, call, logps, entropies, vocab):
        inputs, state = call.inputs, call.state
        original = inputs["advantages"] if state is None else state.advantages
        apply(call, logps, entropies, vocab)
        unit = None if state is None else state.unit_flow
        rollouts.append(
            dict(
                original=_per_token(original, logps),
                applied=inputs["advantages"],
                unit=flow_per_unit_advantage(logps, entropies) if unit is None else unit,
                ratio=inputs["importance_sampling_ratio"],
                mask=inputs["completion_mask"].float(),
                tokens=inputs["num_items_in_batch"],
            )
        )

    args = make_config(
        tmp_path, gradient_accumulation_steps=accumulation, per_device_train_batch_size=8 // accumulation
    )
    trainer = OPEFOTrainer(model=tiny_model_path, reward_funcs=length_reward, args=args, train_dataset=tiny_dataset)
    spy(trainer.micro_batches, "apply", record)
    # The trainer as built for vLLM with importance-sampling correction: TRL scores the rollout and weights the loss.
    trainer.vllm_importance_sampling_correction = True
    trainer.loss_mirror.importance_sampling_correction = True
    trainer.rollout.trl_scores_rollout = True
    trainer.train()
    assert len(emulated_vllm) == 2 and len(rollouts) == 2 * accumulation
    for step in range(2):
        parts = rollouts[step * accumulation : (step + 1) * accumulation]
        factor = torch.cat([p["mask"] * p["ratio"] / p["tokens"] for p in parts])
        unit, original = torch.cat([p["unit"] for p in parts]), torch.cat([p["original"] for p in parts])
        applied = torch.cat([p["applied"] for p in parts])
        net = (factor * applied * unit).double().sum().item()
        gross = (factor * (applied * unit).abs()).double().sum().item()
        assert abs(net) <= 1e-5 * gross
        # The sequences the importance weight zeroes change nothing: lambda* of the others alone is the same.
        kept = factor[:, 0] > 0
        assert (~kept).any()
        alone = flow_stats((original * unit)[kept], factor[kept]).lambda_star.item()
        assert logged(trainer, "entropy_flow/lambda")[step] == pytest.approx(alone, rel=1e-6, abs=1e-9)
        everyone = flow_stats(original * unit, torch.cat([p["mask"] for p in parts])).lambda_star.item()
        assert everyone != pytest.approx(alone, rel=1e-3)


def _per_token(advantages, like):
    return advantages[:, None].expand_as(like) if advantages.dim() == 1 else advantages


def test_par_coefficient_survives_resume_from_checkpoint(train, tiny_model_path, tiny_dataset, length_reward, tmp_path):
    args = make_config(tmp_path, method="par", par_coef_init=0.5, save_strategy="steps", save_steps=2, max_steps=2)
    first = train(args)
    checkpoint = os.path.join(args.output_dir, "checkpoint-2")
    with open(os.path.join(checkpoint, "opefo_method_state.json")) as f:
        saved = json.load(f)
    assert saved == {"method": "par", "state": {"coef": first.token_method.coef, "adaptive": True}}
    assert first.token_method.coef != 0.5  # the controller moved, so a reset would be visible

    # Resume and take one more step: the coefficient it applies is the one the first run handed on.
    more = make_config(tmp_path, method="par", par_coef_init=0.5, save_strategy="no", max_steps=3)
    resumed = make_trainer(tiny_model_path, tiny_dataset, length_reward, more)
    assert resumed.token_method.coef == 0.5
    resumed.train(resume_from_checkpoint=checkpoint)
    step3 = [entry for entry in resumed.state.log_history if entry.get("step") == 3 and "par/coef" in entry]
    assert step3 and step3[0]["par/coef"] == pytest.approx(first.token_method.coef)
    # `True`: the last checkpoint of output_dir, checkpoint-2 again, and its state with it.
    latest = make_trainer(tiny_model_path, tiny_dataset, length_reward, more)
    latest.train(resume_from_checkpoint=True)
    step3 = [entry for entry in latest.state.log_history if entry.get("step") == 3 and "par/coef" in entry]
    assert step3 and step3[0]["par/coef"] == pytest.approx(first.token_method.coef)

    other = make_config(tmp_path, method="grpo", save_strategy="steps", save_steps=2, max_steps=2)
    mismatched = make_trainer(tiny_model_path, tiny_dataset, length_reward, other)
    with pytest.raises(ValueError, match="trained with method='par'"):
        mismatched.train(resume_from_checkpoint=checkpoint)


def test_a_users_grpo_config_is_kept_as_it_is(tiny_model_path, tiny_dataset, length_reward, tmp_path):
    """Drop-in: the trainer keeps the very object, its class and its extra fields, and adds the OPEFO options."""
    from dataclasses import dataclass, field

    from transformers import TrainerCallback
    from trl import GRPOConfig

    @dataclass
    class MyConfig(GRPOConfig):
        my_note: str = field(default="kept", metadata={"help": "a field of the user's own"})

    read = []

    class ReadsMyField(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            read.append(args.my_note)

    args = MyConfig(**base_settings(tmp_path, max_steps=1))
    trainer = make_trainer(tiny_model_path, tiny_dataset, length_reward, args, callbacks=[ReadsMyField()])
    assert trainer.args is args and type(trainer.args) is MyConfig
    assert args.method == "opefo" and args.entropy_flow_estimate == "opefo" and args.opefo_lambda is None
    trainer.train()
    assert read == ["kept"]
    assert logged(trainer, "opefo/weighted_net") and logged(trainer, "entropy_flow/lambda")


def test_the_model_card_names_and_cites_the_opefo_paper(tiny_model_path, tiny_dataset, length_reward, tmp_path):
    """The card TRL writes on `save_model` / `push_to_hub` says which method trained the model and cites its paper,
    then GRPO's (GRPOTrainer's own entry names DeepSeekMath alone)."""
    trainer = make_trainer(tiny_model_path, tiny_dataset, length_reward, make_config(tmp_path))
    trainer.create_model_card(model_name="tiny-opefo", dataset_name="tiny/arithmetic")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "This model was trained with OPEFO, a method introduced in [Understanding and Preventing Entropy " in card
    assert "(https://huggingface.co/papers/2605.11491)" in card
    assert "- opefo" in card  # the hub tag, beside trl and grpo
    opefo_entry, grpo_entry = card.index("eprint    = {arXiv:2605.11491}"), card.index("arXiv:2402.03300")
    assert card.index("Cite OPEFO as:") < opefo_entry < grpo_entry < card.index("Cite TRL as:")


def test_an_off_policy_grpo_config_is_refused_with_a_fix_that_works_for_it(
    tiny_model_path, tiny_dataset, length_reward, tmp_path
):
    from trl import GRPOConfig

    settings = base_settings(tmp_path, num_iterations=2)
    for fix, line in (("method", 'args.method = "grpo"'), ("allow_off_policy", "args.allow_off_policy = True")):
        args = GRPOConfig(**settings)
        with pytest.raises(ValueError) as error:
            make_trainer(tiny_model_path, tiny_dataset, length_reward, args)
        assert f"set `{line}`" in str(error.value)
        # The one line the message names, on the very object that was refused, is the fix.
        exec(line, {"args": args})
        trainer = make_trainer(tiny_model_path, tiny_dataset, length_reward, args)
        assert trainer.args is args and getattr(args, fix) in ("grpo", True)
    with pytest.raises(ValueError, match=r"`OPEFOConfig\(\.\.\., allow_off_policy=True\)`"):
        OPEFOConfig(**settings)
    OPEFOConfig(**settings, allow_off_policy=True)


def test_the_hidden_state_hook_lives_only_during_the_forward_that_needs_it(train, tmp_path):
    trainer = train(
        make_config(
            tmp_path, entropy_flow_estimate="full", gradient_accumulation_steps=2, per_device_train_batch_size=4
        )
    )
    assert logged(trainer, "entropy_flow/lambda")
    assert not trainer.scorer.core().base_model._forward_hooks


def _scoring_passes(trainer):
    """Backbone forwards other than single-token decoding (prefill + scoring), over the whole run."""
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
        # several micro-batches: log pi and H read from generation's logits (trainer/generation_stats.py)
        (dict(gradient_accumulation_steps=2, per_device_train_batch_size=4), 0),
        # the same, when generation's statistics are not read: a no-grad pass over the rollout, per micro-batch
        (dict(gradient_accumulation_steps=2, per_device_train_batch_size=4, from_generation=False), 2),
    ],
    ids=["single_micro_batch", "trl_scoring_pass_reused", "accumulation", "accumulation_scoring_pass"],
)
def test_opefo_adds_a_forward_pass_only_when_trl_has_none_to_share(
    tiny_model_path, tiny_dataset, length_reward, tmp_path, overrides, extra_calls
):
    from trl import GRPOConfig, GRPOTrainer

    overrides = dict(overrides)
    from_generation = overrides.pop("from_generation", True)
    settings = base_settings(tmp_path, **{k: v for k, v in overrides.items() if k != "allow_off_policy"})
    grpo = _scoring_passes(
        make_trainer(tiny_model_path, tiny_dataset, length_reward, GRPOConfig(**settings), GRPOTrainer)
    )
    trainer = make_trainer(tiny_model_path, tiny_dataset, length_reward, make_config(tmp_path, **overrides))
    if not from_generation:
        trainer.rollout.generation = None
    opefo = _scoring_passes(trainer)
    rollouts = 2 if overrides.get("num_iterations") is None else 1  # max_steps=2
    assert opefo - grpo == extra_calls * rollouts


@pytest.mark.numerics
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
def test_every_micro_batch_gets_the_weights_exactly_once(
    tiny_model_path, tiny_dataset, length_reward, tmp_path, overrides
):
    """TRL must see A * w with w = token_weights(d, lambda*) on every token: never A alone, never A * w^2."""
    seen, lambdas = [], []

    def record(apply, call, logps, entropies, vocab):
        inputs, state = call.inputs, call.state
        original = _per_token(inputs["advantages"] if state is None else state.advantages, logps).clone()
        unit = None if state is None else state.unit_flow
        if unit is None:  # weights from the training forward: the same log-probs give the same flow
            unit = flow_per_unit_advantage(logps, entropies)
        apply(call, logps, entropies, vocab)
        seen.append(dict(original=original, applied=inputs["advantages"], unit=unit, lam=lambdas[-1]))

    def record_lambda(rollout_weights, batch, context):
        weights = rollout_weights(batch, context)
        lambdas.append(weights.lam)
        return weights

    args = make_config(tmp_path, max_steps=4, **overrides)
    trainer = make_trainer(tiny_model_path, tiny_dataset, length_reward, args)
    spy(trainer.micro_batches, "apply", record)
    spy(trainer.token_method, "rollout_weights", record_lambda)
    trainer.train()
    assert len(seen) == 4 * args.gradient_accumulation_steps
    assert all(lam != 0 for lam in lambdas)
    for record in seen:
        expected = record["original"] * token_weights(record["original"] * record["unit"], record["lam"])
        torch.testing.assert_close(record["applied"], expected, rtol=1e-6, atol=0)
        assert not torch.allclose(record["applied"], record["original"], rtol=1e-6, atol=0)


@pytest.mark.numerics
def test_a_reused_rollouts_logged_flow_has_trls_per_sequence_factor_of_its_micro_batches(
    warm_model_path, tiny_dataset, length_reward, tmp_path
):
    """num_iterations=2 with `grpo`: the rollout is weighed whole, before TRL splits it into steps_per_generation
    micro-batches (which both updates reuse), and grpo's f_t = 1 / (n_i B K) depends on their row count B. Each step
    logs the flow of the micro-batches it trained on under that f_t, written out here from TRL's normaliser; a factor
    for the steps_per_generation x num_iterations parts of half the rows would double P and N (lambda*, a ratio, does
    not move). The warm model's completions end at different lengths, so n_i varies."""
    seen = []

    def record(apply, call, logps, entropies, vocab):
        state = call.state
        seen.append((call.inputs["completion_mask"].double(), state.advantages * state.unit_flow))
        apply(call, logps, entropies, vocab)

    accumulation, rows = 2, 4
    args = make_config(
        tmp_path, loss_type="grpo", num_iterations=2, allow_off_policy=True, gradient_accumulation_steps=accumulation,
        per_device_train_batch_size=rows,
    )  # fmt: skip
    trainer = make_trainer(warm_model_path, tiny_dataset, length_reward, args)
    assert trainer.rollout.weighs_before_split
    spy(trainer.micro_batches, "apply", record)
    trainer.train()
    assert len(seen) == 2 * accumulation
    assert len(torch.cat([mask.sum(-1) for mask, _ in seen]).unique()) > 1, "the lengths should vary"
    for step in range(2):
        expected = None
        for mask, flow in seen[step * accumulation : (step + 1) * accumulation]:
            factor = mask / (mask.sum(-1, keepdim=True).clamp(min=1) * rows * accumulation)
            stats = flow_stats(flow, factor)
            expected = stats if expected is None else expected + stats
        # The trainer's f_t is the float32 rounding of the same quotient (2^-24 relative); P and N are sums of terms
        # of one sign, so they carry at most that relative error.
        for name in ("increase", "decrease"):
            found = logged(trainer, f"entropy_flow/{name}")[step]
            assert found == pytest.approx(float(getattr(expected, name)), rel=2**-24, abs=0), (step, name)


def test_clip_cov_off_policy_uses_trl_clip_range_and_never_drops_a_ppo_clipped_token(train, tmp_path):
    """epsilon_high unset means 'same as epsilon' in TRL; the second update on a rollout has ratios != 1, and the
    tokens PPO clips there must not be picked again."""
    picks = []

    def record_picks(trainer):
        def record(select, batch):
            dropped = select(batch)
            picks.append((dropped, trainer.token_method.ppo_clipped(batch)))
            return dropped

        spy(trainer.token_method, "select", record)

    args = make_config(
        tmp_path, method="clip_cov", num_iterations=2, learning_rate=0.05, clip_cov_lb=-1e9, clip_cov_ub=1e9,
        clip_cov_ratio=0.2, max_steps=4,
    )  # fmt: skip
    trainer = train(args, setup=record_picks)
    assert args.epsilon_high is None and trainer.token_method.epsilon_high == trainer.token_method.epsilon_low == 0.2
    assert any(clipped.any() for _, clipped in picks), "no update moved a ratio out of [0.8, 1.2]: test is void"
    for dropped, clipped in picks:
        assert dropped.any() and not (dropped & clipped).any()


def test_the_regime_guard_warns_once_when_lambda_stays_large(train, tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = train(make_config(tmp_path, max_steps=21, opefo_lambda_warn=1e-9))
    guard = [w for w in caught if "(> opefo_lambda_warn=" in str(w.message)]
    assert len(guard) == 1 and "entropy_flow_estimate='param'" in str(guard[0].message)
    assert len(logged(trainer, "entropy_flow/lambda")) == 21


def test_the_audit_measures_the_entropy_change_of_the_audited_steps_only(train, tmp_path):
    """An SGD step of learning rate 0 changes nothing: the measured change is exactly 0, on steps 2 and 4."""
    args = make_config(tmp_path, method="grpo", optim="sgd", learning_rate=0.0, max_steps=4, entropy_flow_audit_steps=2)
    trainer = train(args)
    audited = [entry["step"] for entry in trainer.state.log_history if "entropy_flow/measured_delta" in entry]
    assert audited == [2, 4]
    assert logged(trainer, "entropy_flow/measured_delta") == [0.0, 0.0]


def _audit(trainer, *names):
    return [logged(trainer, f"entropy_flow/{name}") for name in names]


@pytest.mark.numerics
def test_param_with_sgd_predicts_the_measured_change_and_opefo_cancels_it(
    warm_model_path, tiny_dataset, length_reward, tmp_path
):
    """Plain SGD, preconditioner 'none': the first-order change predicted from the step's real gradient before it,
    and the one of the real parameter change after it, against the audit's re-scored change on every step; on the
    same first rollout batch OPEFO changes entropy >= 20x less than GRPO."""
    runs = {}
    for method in ("grpo", "opefo"):
        args = make_config(
            tmp_path, method=method, entropy_flow_estimate="param", entropy_flow_preconditioner="none", optim="sgd",
            learning_rate=2e-3, max_steps=3, entropy_flow_audit_steps=1, lr_scheduler_type="constant",
        )  # fmt: skip
        trainer = make_trainer(warm_model_path, tiny_dataset, length_reward, args)
        trainer.train()
        runs[method] = _audit(trainer, "measured_delta", "predicted_delta", "step_first_order")
    (grpo_measured, grpo_predicted, grpo_first), (opefo_measured, opefo_predicted, _) = runs["grpo"], runs["opefo"]
    assert len(grpo_measured) == len(grpo_predicted) == len(grpo_first) == 3
    for m, p, f in zip(grpo_measured, grpo_predicted, grpo_first, strict=True):
        assert abs(m) > 1e-4 and m == pytest.approx(p, rel=0.15)
        assert f == pytest.approx(p, rel=1e-2)  # the real update is lr * g, up to float32 rounding of theta
    assert abs(opefo_predicted[0]) <= 0.05 * abs(grpo_predicted[0])
    assert abs(grpo_measured[0]) >= 20 * abs(opefo_measured[0]), (grpo_measured[0], opefo_measured[0])


@pytest.mark.numerics
def test_grpo_with_param_and_adamw_predicts_the_measured_change_at_a_small_learning_rate(
    warm_model_path, tiny_dataset, length_reward, tmp_path
):
    """torch AdamW (default betas), lr 1e-5: the first-order prediction from the real gradient and Adam's state is
    within 5% of the re-scored change on every step, and equals the first order of the real parameter change."""
    args = make_config(
        tmp_path, method="grpo", entropy_flow_estimate="param", learning_rate=1e-5, max_steps=4, optim="adamw_torch",
        entropy_flow_audit_steps=1, lr_scheduler_type="constant", max_grad_norm=1e9,
    )  # fmt: skip
    trainer = make_trainer(warm_model_path, tiny_dataset, length_reward, args)
    trainer.train()
    measured, predicted, first_order = _audit(trainer, "measured_delta", "predicted_delta", "step_first_order")
    assert len(measured) == 4
    for m, p, f in zip(measured, predicted, first_order, strict=True):
        assert abs(m) > 1e-5 and m == pytest.approx(p, rel=0.05)
        assert f == pytest.approx(p, rel=1e-2)


@pytest.fixture(scope="module")
def warm_model_float64(warm_model_path, keep_dtype_rms_norm):
    """Loads the warm model in float64 throughout: the real parameter change is then free of float32 rounding, so a
    first-order change can be compared down to 1e-3 of GRPO's."""
    from transformers import AutoModelForCausalLM

    def load():
        return keep_dtype_rms_norm(AutoModelForCausalLM.from_pretrained(warm_model_path, dtype=torch.float64))

    return load


@pytest.mark.numerics
def test_the_step_balance_zeroes_the_first_order_change_of_the_real_adamw_step(
    warm_model_float64, warm_model_path, tiny_dataset, length_reward, tmp_path
):
    """opefo_balance='step', torch AdamW with default betas, from Adam's first step: the first-order change of the
    parameters the optimizer really wrote (entropy_flow/step_first_order, independent of how lambda was chosen) is
    <= 1e-3 of GRPO's step on the same batch and state (opefo/step_change_unweighted), and on the first batch, which
    both runs share, the re-scored change is a small fraction of GRPO's."""
    from transformers import AutoTokenizer

    runs = {}
    for method, balance in (("grpo", {}), ("opefo", dict(opefo_balance="step"))):
        args = make_config(
            tmp_path, method=method, entropy_flow_estimate="param", learning_rate=1e-5, max_steps=4,
            optim="adamw_torch", entropy_flow_audit_steps=1, lr_scheduler_type="constant", max_grad_norm=1e9,
            **balance,
        )  # fmt: skip
        trainer = OPEFOTrainer(
            model=warm_model_float64(),
            processing_class=AutoTokenizer.from_pretrained(warm_model_path),
            reward_funcs=length_reward,
            args=args,
            train_dataset=tiny_dataset,
        )
        assert trainer.model.lm_head.weight.dtype == torch.float64  # not rounded by cast_lm_head_to_fp32
        trainer.train()
        runs[method] = trainer
    grpo_measured = logged(runs["grpo"], "entropy_flow/measured_delta")
    measured, first_order = _audit(runs["opefo"], "measured_delta", "step_first_order")
    unweighted = logged(runs["opefo"], "opefo/step_change_unweighted")
    assert len(first_order) == len(unweighted) == 4
    for f, u in zip(first_order, unweighted, strict=True):
        assert abs(f) <= 1e-3 * abs(u), (first_order, unweighted)
    assert unweighted[0] == pytest.approx(logged(runs["grpo"], "entropy_flow/step_first_order")[0], rel=1e-6)
    assert abs(measured[0]) <= 0.05 * abs(grpo_measured[0]), (measured[0], grpo_measured[0])
    assert all(abs(lam) < 1 for lam in logged(runs["opefo"], "opefo/lambda_applied"))


def _first_rollout(tiny_model_path, tiny_dataset, length_reward, args):
    """A trainer and its first rollout batch's micro-batches before OPEFO processed them."""
    trainer = make_trainer(tiny_model_path, tiny_dataset, length_reward, args)
    captured = []

    def capture(weigh, batches):
        captured.append([{k: v.clone() if torch.is_tensor(v) else v for k, v in b.items()} for b in batches])
        weigh(batches)

    spy(trainer.rollout, "weigh", capture)
    trainer.create_optimizer()
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    first_rollout(trainer)
    return trainer, captured[0]


@pytest.mark.numerics
def test_param_under_bf16_autocast_gives_the_float32_lambda_star(
    tiny_model_path, tiny_dataset, length_reward, tmp_path
):
    """bf16=True (autocast over float32 weights, the DDP recipes' setting): the estimate's own passes, forward and
    backward, run in float32 although accelerate wraps the model's forward in autocast and the rollout is weighed
    inside an autocast region, so lambda* of the same batch is float32's (to 1e-3)."""
    overrides = dict(entropy_flow_estimate="param", gradient_accumulation_steps=2, per_device_train_batch_size=4)
    fp32, batches = _first_rollout(tiny_model_path, tiny_dataset, length_reward, make_config(tmp_path, **overrides))
    bf16 = make_trainer(tiny_model_path, tiny_dataset, length_reward, make_config(tmp_path, bf16=True, **overrides))
    bf16.model = bf16.accelerator.prepare(bf16.model)  # as Trainer.train does: wraps the forward in autocast
    assert hasattr(bf16.accelerator.unwrap_model(bf16.model), "_original_forward")
    bf16.create_optimizer()
    bf16.current_gradient_accumulation_steps = 2
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as inside a training step under bf16 mixed precision
        bf16.rollout.weigh([dict(b) for b in batches])
    ours, reference = bf16.token_method.lambda_star, fp32.token_method.lambda_star
    assert ours == pytest.approx(reference, rel=1e-3)
    assert ours != 0.0


def test_param_refuses_weights_and_optimizers_it_cannot_model(tiny_model_path, tiny_dataset, length_reward, tmp_path):
    args = make_config(tmp_path, entropy_flow_estimate="param", model_init_kwargs={"dtype": "bfloat16"})
    with pytest.raises(ValueError, match=r"float32 or float64, but the trainable parameters are \['torch.bfloat16'\]"):
        make_trainer(tiny_model_path, tiny_dataset, length_reward, args)
    with pytest.raises(ValueError, match="models the update of adamw_torch / adamw_torch_fused, but optim='sgd'"):
        make_config(tmp_path, entropy_flow_estimate="param", optim="sgd")
    with pytest.raises(ValueError, match=r"'none' models the update of sgd, but optim='adamw_torch_fused'"):
        make_config(tmp_path, entropy_flow_estimate="param", entropy_flow_preconditioner="none")
    # A custom optimizer is checked when the trainer takes it, before the first step.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    trainer = OPEFOTrainer(
        model=model, reward_funcs=length_reward, args=make_config(tmp_path, entropy_flow_estimate="param"),
        train_dataset=tiny_dataset, optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None),
    )  # fmt: skip
    with pytest.raises(ValueError, match="'adam' models the update of Adam/AdamW, but the optimizer is SGD"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_trl_reads_the_advantages_after_the_scoring_call(tiny_model_path, tiny_dataset, length_reward, tmp_path):
    """The token method writes its weights into inputs["advantages"] inside TRL's scoring call of the loss; TRL 1.16
    reads them after it. Weights of 0 must then zero the policy gradient: SGD leaves every parameter as it was,
    where the same run without them moves the parameters. If a TRL version read the advantages before the scoring
    call, the weights would be silently dropped and this test fails."""

    def zero_weights(apply, call, logps, entropies, vocab):
        apply(call, logps, entropies, vocab)
        call.inputs["advantages"] = torch.zeros_like(call.inputs["advantages"])

    moved = {}
    for zeroed in (True, False):
        args = make_config(tmp_path, method="grpo", optim="sgd", learning_rate=0.5, max_steps=1, max_grad_norm=0)
        trainer = make_trainer(tiny_model_path, tiny_dataset, length_reward, args)
        if zeroed:
            spy(trainer.micro_batches, "apply", zero_weights)
        before = [p.detach().clone() for p in trainer.model.parameters()]
        trainer.train()
        moved[zeroed] = any(
            not torch.equal(p.detach(), b) for p, b in zip(trainer.model.parameters(), before, strict=True)
        )
    assert moved == {True: False, False: True}


@pytest.mark.parametrize("sampling", ["vllm_correction", "transformers"])
def test_the_papers_method_trains_through_two_private_trl_methods_with_its_weights_set_before_the_split(
    tiny_model_path, tiny_dataset, length_reward, tmp_path, sampling
):
    """The paper's method (`opefo`, the recipes' dapo loss) on two micro-batches per rollout, with TRL's vLLM
    importance-sampling pass (emulated) and with transformers' sampling: the only private TRL methods of the trainer's
    that run are `_generate_and_score_completions` and `_get_per_token_logps_and_entropies`, and every micro-batch
    reaches the loss with its (B, T) weighted advantages already set (nothing is weighed at the loss)."""
    from contextlib import nullcontext

    from trl import GRPOTrainer

    from opefo_trl.testing import vllm_generation_emulated

    args = make_config(tmp_path, gradient_accumulation_steps=2, per_device_train_batch_size=4, max_steps=2)
    trainer = make_trainer(tiny_model_path, tiny_dataset, length_reward, args)
    private = [
        name
        for name, value in vars(OPEFOTrainer).items()
        if callable(value) and name.startswith("_") and not name.startswith("__") and hasattr(GRPOTrainer, name)
    ]
    called, weighed_before_split, advantages_at_loss = set(), [], []
    for name in private:
        spy(trainer, name, lambda original, *args, name=name, **kwargs: called.add(name) or original(*args, **kwargs))
    spy(
        trainer.rollout,
        "weigh",
        lambda weigh, batches, **kw: weighed_before_split.append(bool(kw)) or weigh(batches, **kw),
    )

    def compute_loss(loss, model, inputs, *args, **kwargs):
        advantages_at_loss.append(inputs["advantages"].dim())
        return loss(model, inputs, *args, **kwargs)

    spy(trainer, "compute_loss", compute_loss)
    with vllm_generation_emulated(trainer) if sampling == "vllm_correction" else nullcontext():
        trainer.train()
    assert called == {"_generate_and_score_completions", "_get_per_token_logps_and_entropies"}, called
    assert weighed_before_split == [True, True] and advantages_at_loss == [2, 2, 2, 2]
    assert len(logged(trainer, "entropy_flow/lambda")) == 2
