"""opefo_trl.trainer.loss_mirror against TRL's own loss, for every loss type: the per-token factor f_t is the gradient
of TRL's loss, and an extra per-token term is aggregated exactly like TRL's policy loss."""

import pytest
import torch
from trainer_setup import first_rollout, make_config, make_trainer

from opefo_trl.trainer.batch_state import STATE_KEY
from opefo_trl.trainer.loss_mirror import LOSS_TYPES, LossMirror

pytestmark = pytest.mark.numerics


def _micro_batch_with_unequal_lengths(trainer):
    """The first micro-batch TRL would train on (accumulation 2), with completions of different lengths."""
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    inputs = first_rollout(trainer)
    inputs = {k: v for k, v in inputs.items() if k != STATE_KEY}
    lengths = inputs["completion_mask"].sum(-1)
    assert len(lengths.unique()) > 1, "the warm model should end its completions at different lengths"
    return inputs


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_the_loss_factor_is_the_gradient_of_trls_loss_per_token(
    warm_model_path, tiny_dataset, length_reward, tmp_path, loss_type
):
    """f_t A_t = -dL/d log pi_t of TRL's real loss at ratio 1 (docs/algorithm.md section 2), token by token, on a
    micro-batch with completions of unequal lengths, accumulation 2, a token-level vLLM importance ratio and TRL's
    high-entropy mask. A copy that gave `grpo` `bnpo`'s normaliser (they agree when all lengths are equal) fails."""
    from trl import GRPOTrainer

    extra = dict(vllm_importance_sampling_mode="token_truncate") if loss_type == "vespo" else {}
    args = make_config(
        tmp_path, loss_type=loss_type, gradient_accumulation_steps=2, per_device_train_batch_size=4,
        top_entropy_quantile=0.6, **extra,
    )  # fmt: skip
    trainer = make_trainer(warm_model_path, tiny_dataset, length_reward, args)
    inputs = _micro_batch_with_unequal_lengths(trainer)
    gen = torch.Generator().manual_seed(0)
    batch, length = inputs["completion_ids"].shape
    inputs["advantages"] = torch.randn(batch, generator=gen)
    inputs["importance_sampling_ratio"] = 0.5 + torch.rand(batch, length, generator=gen)
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        logps, entropies, _ = GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, trainer.model, ids, attention, length, compute_entropy=True
        )
    inputs["old_per_token_logps"] = logps.clone()  # ratio 1
    leaf = logps.clone().requires_grad_(True)
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (leaf, entropies, None)
    loss = GRPOTrainer._compute_loss(trainer, trainer.model, inputs)
    (gradient,) = torch.autograd.grad(loss, leaf)
    factor = LossMirror.of(trainer).factor(inputs, logps, entropies, inputs["advantages"])
    assert (factor == 0).any() and (factor > 0).any()  # masks and the entropy mask at work
    expected = -factor * inputs["advantages"][:, None]
    torch.testing.assert_close(gradient, expected, rtol=1e-5, atol=1e-8 * expected.abs().max().item())


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_extra_loss_terms_are_normalised_exactly_like_trl_policy_loss(
    warm_model_path, tiny_dataset, length_reward, tmp_path, loss_type
):
    """With A = -1 and ratio 1, TRL's policy loss is its own aggregation of a known per-token value (1 for the
    clipped losses, 2 / tau_neg for SAPO, log pi for VESPO and CISPO, clamped for CISPO): ours must match it."""
    from trl import GRPOTrainer

    extra = dict(vllm_importance_sampling_mode="token_truncate") if loss_type == "vespo" else {}
    args = make_config(
        tmp_path, loss_type=loss_type, gradient_accumulation_steps=2, per_device_train_batch_size=4, **extra
    )
    trainer = make_trainer(warm_model_path, tiny_dataset, length_reward, args)
    inputs = _micro_batch_with_unequal_lengths(trainer)
    inputs["advantages"] = -torch.ones_like(inputs["completion_mask"], dtype=torch.float32)
    with torch.no_grad():
        trl_loss = GRPOTrainer._compute_loss(trainer, trainer.model, inputs)
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        logps, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, trainer.model, ids, attention, inputs["completion_ids"].size(1)
        )
    per_token = {
        "cispo": logps * min(1.0, trainer.epsilon_high),  # CISPO's clamp(ratio, max=epsilon_high) at ratio 1
        "vespo": logps,
        "sapo": torch.full_like(logps, 2 / args.sapo_temperature_neg),
    }
    value = per_token.get(loss_type, torch.ones_like(logps))
    ours = LossMirror.of(trainer).aggregate(value, inputs)
    assert ours.item() == pytest.approx(trl_loss.item(), rel=1e-5)


def _trl_loss_on_a_leaf(trainer, inputs):
    """TRL's own loss of ``inputs`` computed on a leaf holding the policy's log pi_t (ratio 1), and that leaf."""
    from trl import GRPOTrainer

    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        logps, entropies, _ = GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, trainer.model, ids, attention, inputs["completion_ids"].size(1), compute_entropy=True
        )
    leaf = logps.clone().requires_grad_(True)
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (leaf, entropies, None)
    return GRPOTrainer._compute_loss(trainer, trainer.model, inputs), leaf, entropies


@pytest.mark.parametrize(
    "settings",
    [
        dict(),
        dict(loss_type="grpo", top_entropy_quantile=0.6),
        dict(loss_type="bnpo", beta=0.1),
        dict(loss_type="dr_grpo", beta=0.1, use_bias_correction_kl=False),
        dict(loss_type="cispo", vllm_ratio=True),
    ],
    ids=["dapo", "grpo_entropy_mask", "kl", "kl_without_bias_correction", "vllm_ratio"],
)
def test_the_first_micro_batch_guard_accepts_every_modelled_update(
    warm_model_path, tiny_dataset, length_reward, tmp_path, settings
):
    """The guard's expected gradient, -W f_t A_t w_t plus the KL term's (with and without TRL's bias correction),
    against TRL's real loss with weighted advantages (B, T), a reference policy away from the policy and a vLLM ratio:
    float32 against float64 arithmetic of the same expressions, ~1e-7 relative (GUARD_TOLERANCE is 1e-2). A guard
    without the KL term, or a mirror without the vLLM ratio, fails here."""
    settings = dict(settings)
    vllm_ratio = settings.pop("vllm_ratio", False)
    args = make_config(tmp_path, gradient_accumulation_steps=2, per_device_train_batch_size=4, **settings)
    trainer = make_trainer(warm_model_path, tiny_dataset, length_reward, args)
    inputs = _micro_batch_with_unequal_lengths(trainer)
    gen = torch.Generator().manual_seed(0)
    shape = inputs["completion_ids"].shape
    inputs["advantages"] = torch.randn(shape[0], generator=gen)[:, None] * (0.5 + torch.rand(shape, generator=gen))
    if vllm_ratio:
        inputs["importance_sampling_ratio"] = 0.5 + torch.rand(shape, generator=gen)
        trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    if trainer.beta:
        inputs["ref_per_token_logps"] = inputs.get("old_per_token_logps", torch.zeros(shape)) - 1
    loss, leaf, entropies = _trl_loss_on_a_leaf(trainer, inputs)
    if trainer.beta:
        inputs["ref_per_token_logps"] = leaf.detach() - 0.3 * torch.rand(shape, generator=gen)
        loss, leaf, entropies = _trl_loss_on_a_leaf(trainer, inputs)
    mirror = LossMirror.of(trainer)
    factor = mirror.factor(inputs, leaf.detach(), entropies, inputs["advantages"])
    assert mirror.check_against_trl(loss, leaf, inputs, factor) < 1e-5


def test_the_first_micro_batch_guard_stops_an_update_the_mirror_does_not_model(
    warm_model_path, tiny_dataset, length_reward, tmp_path
):
    """TRL's sequence-level importance ratio (refused at configuration time, set here on the built trainer) moves each
    token's weight onto its whole sequence: the guard stops training on the first micro-batch, naming the option."""
    from opefo_trl.trainer.loss_mirror import LossMirrorMismatch

    args = make_config(tmp_path, gradient_accumulation_steps=2, per_device_train_batch_size=4)
    trainer = make_trainer(warm_model_path, tiny_dataset, length_reward, args)
    trainer.importance_sampling_level = trainer.args.importance_sampling_level = "sequence"
    trainer.micro_batches.loss = trainer.loss_mirror = LossMirror.of(trainer)
    with pytest.raises(LossMirrorMismatch, match=r"differs from the per-token factor .* importance_sampling_level="):
        trainer.train()


def test_where_only_the_diagnostics_read_the_factor_a_mismatch_switches_them_off_and_training_goes_on(
    tiny_model_path, tiny_dataset, length_reward, tmp_path, monkeypatch
):
    """Under plain GRPO (unweighted tokens) the guard's mismatch would only make the diagnostics describe another
    update: they are switched off with one warning, and every optimizer step trains (no refusal of what GRPOTrainer
    trains). The mismatch is forced here: on-policy with w_t = 1, TRL's sequence-level ratio has the token-level
    gradient (measured 8.5e-8), so no real option both passes the configuration and mismatches under GRPO."""
    import warnings

    from opefo_trl.trainer.loss_mirror import LossMirrorMismatch

    def mismatch(self, *args):
        raise LossMirrorMismatch("forced")

    monkeypatch.setattr(LossMirror, "check_against_trl", mismatch)
    args = make_config(tmp_path, method="grpo", gradient_accumulation_steps=2, per_device_train_batch_size=4)
    trainer = make_trainer(tiny_model_path, tiny_dataset, length_reward, args)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    switched_off = [w for w in caught if "diagnostics are switched off" in str(w.message)]
    assert len(switched_off) == 1
    assert trainer.state.global_step == args.max_steps
    assert not any(key.startswith("entropy_flow/") for entry in trainer.state.log_history for key in entry)
    args = make_config(tmp_path / "opefo", gradient_accumulation_steps=2, per_device_train_batch_size=4)
    with pytest.raises(LossMirrorMismatch, match="forced"):  # a method that weighs tokens by the factor stops
        make_trainer(tiny_model_path, tiny_dataset, length_reward, args).train()


def test_the_guard_finds_the_modelled_update_in_training(tiny_model_path, tiny_dataset, length_reward, tmp_path):
    """On a real first micro-batch (OPEFO's weights in the advantages) the guard ran once and found TRL's update."""
    trainer = make_trainer(tiny_model_path, tiny_dataset, length_reward, make_config(tmp_path, max_steps=1))
    trainer.train()
    assert trainer.micro_batches.mirror_difference is not None and trainer.micro_batches.mirror_difference < 1e-5
    assert not trainer.micro_batches.check_mirror
