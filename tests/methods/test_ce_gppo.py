"""CE-GPPO: the kept gradient of the tokens PPO's clip removes, by hand and against TRL's own loss for every clipped
loss type; the authors' dual clip (TRL's delta) and positive-sample NLL term; inert on-policy; what it refuses."""

import sys
import warnings
from pathlib import Path

import pytest
import torch

from opefo_trl.methods import CEGPPO, TokenBatch
from opefo_trl.methods.ce_gppo import PPO_CLIP_LOSS_TYPES

sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))  # trainer_setup


def hand_batch():
    # Ratios 0.5 (A < 0: clipped low), 1.5 (A > 0: clipped high), 1 (A > 0), 0.5 (A > 0: not clipped, TRL's min
    # keeps r A), 1.5 (A < 0: not clipped), and a clipped-looking padding token.
    ratio = torch.tensor([[0.5, 1.5, 1.0, 0.5, 1.5, 0.5]], dtype=torch.float64)
    logps = torch.log(torch.tensor([[0.2, 0.3, 0.4, 0.1, 0.6, 0.2]], dtype=torch.float64))
    factor = torch.ones_like(logps)
    factor[0, 5] = 0
    return TokenBatch(
        logps=logps,
        entropies=torch.ones_like(logps),
        advantages=torch.tensor([[-1.0, 2.0, 1.0, 1.0, -3.0, -1.0]], dtype=torch.float64),
        factor=factor,
        old_logps=logps - ratio.log(),
    )


def test_ce_gppo_gives_clipped_tokens_the_bounded_scaled_gradient():
    batch = hand_batch()
    method = CEGPPO(ce_gppo_beta1=0.75, ce_gppo_beta2=0.5, epsilon_low=0.2, epsilon_high=0.28)
    logps = batch.logps.clone().requires_grad_(True)
    terms = method.micro_batch_terms(batch, logps)
    assert terms.weights is None and terms.extra_loss is None
    assert terms.factor_loss.abs().max() == 0  # value 0: TRL's loss value unchanged
    terms.factor_loss.sum().backward()
    # -d/dlog pi: beta1 (1 - eps_low) A = 0.75 * 0.8 * -1; beta2 (1 + eps_high) A = 0.5 * 1.28 * 2.
    expected = -torch.tensor([[0.75 * 0.8 * -1.0, 0.5 * 1.28 * 2.0, 0, 0, 0, 0]], dtype=torch.float64)
    torch.testing.assert_close(logps.grad, expected, rtol=1e-12, atol=0)
    assert method.pop_metrics() == pytest.approx({"ce_gppo/low_frac": 1 / 5, "ce_gppo/high_frac": 1 / 5})


def test_ce_gppo_clipped_shares_are_summed_over_two_ranks():
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from methods_batch import random_batch, run_ranks, split_rows

    batch = random_batch(seed=11, b=6, t=20, old_shift=lambda g, b, t: torch.randn(b, t, generator=g) * 0.5)
    whole = CEGPPO(epsilon_low=0.2, epsilon_high=0.2)
    whole.micro_batch_terms(batch, batch.logps)
    expected = whole.pop_metrics()
    assert expected["ce_gppo/low_frac"] > 0 and expected["ce_gppo/high_frac"] > 0

    def rank(part, context):
        method = CEGPPO(epsilon_low=0.2, epsilon_high=0.2)
        method.micro_batch_terms(part, part.logps, context)
        return method.pop_metrics()

    for metrics in run_ranks(rank, split_rows(batch, 2)):
        assert metrics == pytest.approx(expected, rel=1e-12)


def test_ce_gppo_is_inert_on_policy():
    batch = hand_batch()
    batch.old_logps = None  # ratio 1
    logps = batch.logps.clone().requires_grad_(True)
    terms = CEGPPO().micro_batch_terms(batch, logps)
    assert terms.extra_loss is None and terms.weights is None
    terms.factor_loss.sum().backward()  # returned on-policy too (every rank computes the same factors), gradient 0
    assert torch.count_nonzero(logps.grad) == 0


def _micro_batch_with_unequal_lengths(trainer):
    from trainer_setup import first_rollout

    from opefo_trl.trainer.batch_state import STATE_KEY

    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    inputs = first_rollout(trainer)
    inputs = {k: v for k, v in inputs.items() if k != STATE_KEY}
    assert len(inputs["completion_mask"].sum(-1).unique()) > 1
    return inputs


@pytest.mark.numerics
@pytest.mark.parametrize("loss_type", PPO_CLIP_LOSS_TYPES)
def test_ce_gppo_on_trl_is_trls_unclipped_gradient_rescaled_on_the_clipped_tokens(
    warm_model_path, tiny_dataset, length_reward, tmp_path, loss_type
):
    """TRL's loss plus CE-GPPO's term weighted by f_t, differentiated per token, against TRL's own loss with the clip
    switched off: the two agree on every token PPO keeps, and on a clipped token the unclipped gradient r A f_t becomes
    beta (1 -/+ eps) A f_t. TRL's aggregation (normaliser, accumulation, unequal lengths), its vLLM importance ratio,
    high-entropy mask and off-policy mask (set; it masks no sequence of this batch) weigh both alike.
    Tolerance: both gradients are float32 sums of a few float32 products (r = exp(log r) in float32 on TRL's side,
    in float64 here), a few ulp (6e-8) relative each; 1e-5 leaves a wide margin."""
    from trainer_setup import make_config, make_trainer
    from trl import GRPOTrainer

    from opefo_trl.trainer.loss_mirror import LossMirror

    args = make_config(
        tmp_path, method="ce_gppo", loss_type=loss_type, gradient_accumulation_steps=2, per_device_train_batch_size=4,
        num_iterations=2, epsilon=0.1, epsilon_high=0.15, ce_gppo_beta1=0.6, ce_gppo_beta2=0.9,
        top_entropy_quantile=0.9, off_policy_mask_threshold=0.3,
    )  # fmt: skip
    trainer = make_trainer(warm_model_path, tiny_dataset, length_reward, args)
    inputs = _micro_batch_with_unequal_lengths(trainer)
    gen = torch.Generator().manual_seed(0)
    batch, length = inputs["completion_ids"].shape
    inputs["advantages"] = torch.randn(batch, generator=gen)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        logps, entropies, _ = GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, trainer.model, ids, attention, length, compute_entropy=True
        )
    inputs["old_per_token_logps"] = logps - 0.5 * torch.randn(batch, length, generator=gen)
    inputs["importance_sampling_ratio"] = 0.5 + torch.rand(batch, length, generator=gen)
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    mirror = LossMirror.of(trainer)
    method = trainer.token_method
    factor = mirror.factor(inputs, logps, entropies, inputs["advantages"])
    token_batch = TokenBatch(
        logps, entropies, inputs["advantages"][:, None].expand(batch, length), factor,
        old_logps=inputs["old_per_token_logps"],
    )  # fmt: skip
    low, high = method.clipped(token_batch)
    kept = factor > 0
    assert (LossMirror.mask(inputs).bool() & ~kept).any()  # the high-entropy mask at work
    assert (low & kept).any() and (high & kept).any() and ((low | high) & ~kept & token_batch.in_loss).sum() == 0
    assert (factor[kept] != factor[kept][0]).any()  # the importance ratio weighs tokens unequally

    def gradient(clip, with_term):
        trainer.epsilon_low, trainer.epsilon_high = clip
        leaf = logps.clone().requires_grad_(True)
        trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (leaf, entropies, None)
        loss = GRPOTrainer._compute_loss(trainer, trainer.model, inputs)
        if with_term:  # as MicroBatchWeigher does: the term times f_t and the ranks (one here)
            loss = loss + (method.micro_batch_terms(token_batch, leaf).factor_loss * factor).sum()
        return torch.autograd.grad(loss, leaf)[0]

    ours = gradient((0.1, 0.15), with_term=True)
    unclipped = gradient((1e9, 1e9), with_term=False).double()
    ratio = (logps.double() - inputs["old_per_token_logps"].double()).exp()
    scale = torch.where(low, 0.6 * (1 - 0.1) / ratio, torch.where(high, 0.9 * (1 + 0.15) / ratio, 1.0))
    expected = unclipped * scale
    assert (expected[(low | high) & kept] != 0).all()
    torch.testing.assert_close(ours.double(), expected, rtol=1e-5, atol=1e-7 * expected.abs().max().item())


def test_ce_gppo_refuses_a_loss_without_ppos_clip_and_warns_on_policy(tmp_path):
    from trainer_setup import make_config

    off_policy = dict(method="ce_gppo", gradient_accumulation_steps=1, steps_per_generation=8)
    with pytest.raises(ValueError, match=r"loss_type='cispo' has no such clip\. Use one of \('grpo'"):
        make_config(tmp_path, loss_type="cispo", **off_policy)
    with pytest.raises(ValueError, match="importance_sampling_level='sequence' clips a sequence's"):
        make_config(tmp_path, importance_sampling_level="sequence", **off_policy)
    with pytest.warns(UserWarning, match="method='ce_gppo' in a strict on-policy configuration is inert"):
        make_config(tmp_path, method="ce_gppo")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*ce_gppo.*")  # off-policy: no inertness warning
        make_config(tmp_path, **off_policy)
    with pytest.raises(ValueError, match=r"ce_gppo_beta1 scales a kept gradient and must lie in \[0, 10\]"):
        CEGPPO(ce_gppo_beta1=-0.1)
    with pytest.raises(ValueError, match=r"ce_gppo_positive_nll_coef must be >= 0 \(0: no NLL term\); got -0.1"):
        CEGPPO(ce_gppo_positive_nll_coef=-0.1)


def test_ce_gppo_trains_off_policy_with_opefo_trainer_and_adds_its_term_on_the_second_update(
    tiny_model_path, tiny_dataset, length_reward, tmp_path
):
    """Two updates on one rollout: the first at ratio 1 clips nothing; on the second, the term added to TRL's loss is
    CE-GPPO's, weighted by the tokens' factors, for exactly the tokens the clip removes."""
    from trainer_setup import logged, make_config, make_trainer, spy

    args = make_config(
        tmp_path, method="ce_gppo", gradient_accumulation_steps=1, steps_per_generation=2,
        per_device_train_batch_size=4, epsilon=0.01, epsilon_high=0.01, learning_rate=0.05,
    )  # fmt: skip
    trainer = make_trainer(tiny_model_path, tiny_dataset, length_reward, args)
    terms, added = [], []

    def record(micro_batch_terms, batch, logps, context):
        result = micro_batch_terms(batch, logps, context)
        terms.append((batch, result, logps))
        return result

    def record_loss(finish, call, loss):  # the added term's gradient in log pi, before the backward frees its graph
        logps = terms[-1][2]
        added.append(torch.autograd.grad(call.factor_loss.sum(), logps, retain_graph=True)[0])
        return finish(call, loss)

    spy(trainer.token_method, "micro_batch_terms", record)
    spy(trainer.micro_batches, "finish", record_loss)
    trainer.train()
    assert len(terms) == len(added) == 2
    (first, _, _), (second, _, _) = terms
    assert not any(mask.any() for mask in trainer.token_method.clipped(first))  # ratio 1 on the first update
    assert torch.count_nonzero(added[0]) == 0
    low, high = trainer.token_method.clipped(second)
    assert (low | high).any()
    # -d/dlog pi of the added term: beta (1 -/+ eps) A f_t on the clipped tokens (defaults 0.75 and 1, eps 0.01).
    kept = low * 0.75 * (1 - 0.01) + high * 1.0 * (1 + 0.01)
    torch.testing.assert_close(added[1], -kept * second.advantages * second.factor, rtol=1e-6, atol=0)
    fractions = logged(trainer, "ce_gppo/low_frac")
    assert fractions[0] == 0 and len(fractions) == 2
    tokens = int(second.in_loss.sum())
    assert fractions[1] == pytest.approx(int(low.sum()) / tokens)
    assert logged(trainer, "ce_gppo/high_frac")[1] == pytest.approx(int(high.sum()) / tokens)


@pytest.mark.numerics
def test_ce_gppo_positive_nll_is_the_authors_term():
    """ce_gppo_positive_nll_coef = 0.1: the term aggregated as TRL's dapo loss aggregates one micro-batch (the sum over
    its tokens in the loss / their count) has the gradient of the authors' positive_loss_coeff * token-mean of -log pi
    over the correct responses (here the rows of positive advantage, as under the authors' dynamic sampling),
    re-implemented from its formula in float64. Off by default. Both are float64: 1e-12."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from methods_batch import random_batch

    batch = random_batch(seed=3, b=6, t=20, old_shift=lambda g, b, t: torch.randn(b, t, generator=g) * 0.5)
    batch.logps, batch.advantages = batch.logps.double(), batch.advantages.double()
    assert (batch.advantages[:, 0] > 0).sum() in range(1, 6)  # some rows correct, some not
    logps = batch.logps.clone().requires_grad_(True)
    assert CEGPPO().micro_batch_terms(batch, logps).extra_loss is None  # off by default
    method = CEGPPO(ce_gppo_positive_nll_coef=0.1)
    terms = method.micro_batch_terms(batch, logps)
    mask = batch.in_loss.double()
    (ours,) = torch.autograd.grad((terms.extra_loss * mask).sum() / mask.sum(), logps)

    leaf = batch.logps.clone().requires_grad_(True)
    correct = batch.advantages[:, 0] > 0
    authors = 0.1 * (-leaf[correct] * mask[correct]).sum() / mask[correct].sum()
    (expected,) = torch.autograd.grad(authors, leaf)
    assert (expected != 0).sum() > 0
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=0)
    positive = batch.in_loss & (batch.advantages > 0)
    nll = float(-batch.logps[positive].mean())
    assert method.pop_metrics()["ce_gppo/positive_nll"] == pytest.approx(nll, rel=1e-12)


def test_ce_gppo_with_the_recipes_delta_gives_a_negative_token_above_ratio_10_no_gradient(
    warm_model_path, tiny_dataset, length_reward, tmp_path
):
    """The authors' dual clip (clip_ratio_c = 10) is TRL's delta = 10, as the CE-GPPO recipes set it: a token of
    negative advantage at ratio ~20 gets no gradient from TRL's loss plus CE-GPPO's term; without delta it gets
    -r A f_t. Every other token's gradient is the same either way."""
    from trainer_setup import make_config, make_trainer
    from trl import GRPOTrainer

    from opefo_trl.trainer.loss_mirror import LossMirror

    args = make_config(
        tmp_path, method="ce_gppo", loss_type="dapo", num_iterations=2, per_device_train_batch_size=4, delta=10.0
    )
    trainer = make_trainer(warm_model_path, tiny_dataset, length_reward, args)
    inputs = _micro_batch_with_unequal_lengths(trainer)
    gen = torch.Generator().manual_seed(1)
    batch, length = inputs["completion_ids"].shape
    inputs["advantages"] = torch.tensor([-1.0, 1.0, -0.5, 2.0])[:batch]
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        logps, entropies, _ = GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, trainer.model, ids, attention, length, compute_entropy=True
        )
    far = torch.rand(batch, length, generator=gen) < 0.3  # ratio e^3 ~ 20 on these, e^(+-0.1) elsewhere
    log_ratio = torch.where(far, torch.full_like(logps, 3.0), 0.1 * torch.randn(batch, length, generator=gen))
    inputs["old_per_token_logps"] = logps - log_ratio
    mask = LossMirror.mask(inputs).bool()
    advantages = inputs["advantages"][:, None].expand(batch, length)
    factor = LossMirror.of(trainer).factor(inputs, logps, entropies, inputs["advantages"])
    token_batch = TokenBatch(logps, entropies, advantages, factor, old_logps=inputs["old_per_token_logps"])
    dual_clipped = far & mask & (advantages < 0)
    assert dual_clipped.sum() > 0

    def gradient(delta):
        trainer.args.delta = delta
        leaf = logps.clone().requires_grad_(True)
        trainer._get_per_token_logps_and_entropies = lambda *a, **k: (leaf, entropies, None)
        loss = GRPOTrainer._compute_loss(trainer, trainer.model, inputs)
        loss = loss + (trainer.token_method.micro_batch_terms(token_batch, leaf).factor_loss * factor).sum()
        return torch.autograd.grad(loss, leaf)[0].double()

    with_delta, without = gradient(10.0), gradient(None)
    assert with_delta[dual_clipped].abs().max() == 0
    ratio = log_ratio.double().exp()
    expected = -ratio * advantages.double() * factor.double()  # units of f_t: -r A
    torch.testing.assert_close(without[dual_clipped], expected[dual_clipped], rtol=1e-5, atol=0)
    torch.testing.assert_close(with_delta[~dual_clipped], without[~dual_clipped], rtol=0, atol=0)
