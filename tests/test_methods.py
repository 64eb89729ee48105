import pytest
import torch

from opefo_trl.entropy_flow import entropy_flow, flow_stats
from opefo_trl.methods import (
    OPEFO,
    PAR,
    TOKEN_METHODS,
    ClipCov,
    KLCov,
    TokenBatch,
    TokenMethod,
    build_token_method,
    covariance_scores,
    register_token_method,
)


def _batch(seed=0, b=4, t=50, old_shift=None):
    gen = torch.Generator().manual_seed(seed)
    logps = -torch.rand(b, t, generator=gen) * 6
    adv = torch.randn(b, generator=gen)[:, None].expand(b, t) * 3
    mask = torch.ones(b, t)
    mask[0, -7:] = 0  # padding
    old = None if old_shift is None else logps - old_shift(gen, b, t)
    return TokenBatch(
        logps=logps, entropies=torch.rand(b, t, generator=gen) * 2, advantages=adv, mask=mask, old_logps=old
    )


def test_registry_lists_every_method_and_unknown_names_list_the_valid_ones():
    assert set(TOKEN_METHODS) >= {"grpo", "opefo", "par", "clip_cov", "kl_cov"}
    with pytest.raises(ValueError, match=r"Unknown method 'opfeo'\. Valid methods: clip_cov, grpo, kl_cov, opefo, par"):
        build_token_method("opfeo")


def test_a_new_method_plugs_in_without_trainer_code():
    @register_token_method("_test_halve")
    class Halve(TokenMethod):
        def micro_batch_terms(self, batch, logps, reduce_sum=lambda x: x):
            from opefo_trl.methods import TokenTerms

            return TokenTerms(weights=torch.full_like(batch.logps, 0.5))

    try:
        batch = _batch()
        assert build_token_method("_test_halve").micro_batch_terms(batch, batch.logps).weights.unique().item() == 0.5
        with pytest.raises(ValueError, match="already registered"):
            register_token_method("_test_halve")(Halve)
    finally:
        TOKEN_METHODS.pop("_test_halve")


def test_covariance_scores_use_means_over_valid_tokens():
    batch = _batch()
    m = batch.mask.bool()
    expected = (batch.advantages - batch.advantages[m].mean()) * (batch.logps - batch.logps[m].mean())
    torch.testing.assert_close(covariance_scores(batch), expected)


def test_clip_cov_drops_exactly_the_budget_inside_the_window_and_never_ppo_clipped_tokens():
    # Half of the tokens get a ratio far outside [0.8, 1.2]: those in the clipped direction must never be picked.
    batch = _batch(seed=1, old_shift=lambda g, b, t: (torch.rand(b, t, generator=g) > 0.5) * 1.0)
    method = ClipCov(ratio=0.05, lower=0.5, upper=4.0, epsilon_low=0.2, epsilon_high=0.2)
    cov = covariance_scores(batch)
    clipped = method.ppo_clipped(batch)
    window = batch.mask.bool() & (cov > 0.5) & (cov < 4.0)
    assert clipped.any() and (window & ~clipped).sum() > 10
    torch.manual_seed(0)
    dropped = method.select(batch)
    n_valid = int(batch.mask.sum())
    assert int(dropped.sum()) == max(1, int(0.05 * n_valid))
    assert not (dropped & ~window).any(), "a token outside (lb, ub) or padding was dropped"
    assert not (dropped & clipped).any(), "a token PPO already clipped was dropped"
    torch.manual_seed(0)  # the same random pick as above
    weights = method.micro_batch_terms(batch, batch.logps).weights
    assert torch.equal(weights, (~dropped).float())
    assert method.pop_metrics()["clip_cov/dropped_frac"] == pytest.approx(int(dropped.sum()) / n_valid)


def test_clip_cov_drops_all_candidates_when_fewer_than_the_budget_and_at_least_one():
    batch = _batch(seed=2)
    cov = covariance_scores(batch)
    top = cov[batch.mask.bool()].max().item()
    method = ClipCov(ratio=0.5, lower=top - 1e-6, upper=top + 1.0)  # exactly one candidate
    assert int(method.select(batch).sum()) == 1
    method = ClipCov(ratio=1e-9, lower=-1e9, upper=1e9)  # budget rounds down to 0: still one token
    assert int(method.select(batch).sum()) == 1
    method = ClipCov(ratio=0.5, lower=1e8, upper=1e9)  # no candidate at all
    assert int(method.select(batch).sum()) == 0


def test_kl_cov_penalises_exactly_the_top_k_with_the_hand_derived_gradient():
    batch = _batch(seed=3, old_shift=lambda g, b, t: torch.randn(b, t, generator=g) * 0.1)
    method = KLCov(ratio=0.03, coef=2.0)
    chosen = method.select(batch)
    valid = batch.mask.bool()
    k = max(1, int(0.03 * int(valid.sum())))
    assert int(chosen.sum()) == k
    cov = covariance_scores(batch)
    assert cov[chosen].min() >= cov[valid & ~chosen].max()
    logps = batch.logps.clone().requires_grad_(True)
    terms = method.micro_batch_terms(batch, logps)
    assert terms.weights is None
    terms.extra_loss.sum().backward()
    expected = 2.0 * torch.sign(batch.logps - batch.old_logps) * chosen
    torch.testing.assert_close(logps.grad, expected)
    assert method.pop_metrics()["kl_cov/penalised_frac"] == pytest.approx(k / int(valid.sum()))


def test_kl_cov_is_inert_on_policy():
    batch = _batch(seed=4)  # old_logps None: ratio 1
    logps = batch.logps.clone().requires_grad_(True)
    KLCov(ratio=0.1).micro_batch_terms(batch, logps).extra_loss.sum().backward()
    assert torch.count_nonzero(logps.grad) == 0


def test_par_scales_only_positive_advantage_tokens():
    batch = _batch(seed=5)
    batch.advantages = torch.tensor([1.5, -0.5, 0.0, 2.0])[:, None].expand_as(batch.logps)
    weights = PAR(coef=0.3).micro_batch_terms(batch, batch.logps).weights
    positive = batch.advantages > 0
    assert positive.any() and (~positive).any()
    torch.testing.assert_close(weights[positive], torch.full_like(weights[positive], 0.3))
    assert torch.all(weights[~positive] == 1.0)


def test_par_controller_moves_by_one_step_per_optimizer_step_within_bounds():
    par = PAR(coef=None, coef_init=0.1, entropy_target=0.2, coef_step=0.05)
    low = TokenBatch(torch.zeros(1, 4), torch.full((1, 4), 0.1), torch.ones(1, 4), torch.ones(1, 4))
    high = TokenBatch(torch.zeros(1, 4), torch.full((1, 4), 0.9), torch.ones(1, 4), torch.ones(1, 4))
    coefs = []
    for batch in [low, low, low, high] + [high] * 25:
        par.micro_batch_terms(batch, batch.logps)
        par.micro_batch_terms(batch, batch.logps)  # two micro-batches, one optimizer step
        par.on_optimizer_step()
        coefs.append(par.coef)
    assert coefs[:4] == pytest.approx([0.05, 0.0, 0.0, 0.05])
    assert max(coefs) == 1.0 and coefs[-1] == 1.0
    steps = torch.tensor(coefs, dtype=torch.float64).diff().abs()
    assert torch.all(steps <= 0.05 + 1e-9)
    assert par.state_dict() == {"coef": 1.0, "adaptive": True}
    fresh = PAR()
    fresh.load_state_dict(par.state_dict())
    assert fresh.coef == 1.0
    constant = PAR(coef=0.3)  # a constant coefficient is configuration: a checkpoint does not override it
    constant.load_state_dict(par.state_dict())
    assert constant.coef == 0.3


def test_par_controller_uses_the_rank_reduced_mean_entropy():
    par = PAR(coef=None, coef_init=0.5)
    par.micro_batch_terms(
        *(lambda b: (b, b.logps))(
            TokenBatch(torch.zeros(1, 2), torch.full((1, 2), 0.1), torch.ones(1, 2), torch.ones(1, 2))
        )
    )
    # Another rank saw 2 tokens of entropy 0.5: global mean (0.2 + 1.0) / 4 = 0.3 >= 0.2 -> coefficient goes up.
    par.on_optimizer_step(reduce_sum=lambda t: t + torch.tensor([1.0, 2.0], dtype=t.dtype))
    assert par.coef == pytest.approx(0.55)
    assert par.pop_metrics()["par/entropy"] == pytest.approx(0.3)


def test_opefo_rollout_weights_balance_the_flow_and_report_metrics():
    batch = _batch(seed=6)
    method = OPEFO()
    weights = method.rollout_weights(batch)
    flow = entropy_flow(batch.logps, batch.entropies, batch.advantages)
    stats = flow_stats(flow, batch.mask)
    metrics = method.pop_metrics()
    assert metrics["entropy_flow/lambda"] == pytest.approx(stats.lambda_star.item())
    assert metrics["entropy_flow/increase"] == pytest.approx(stats.increase.item())
    assert abs(metrics["opefo/weighted_net"]) < 1e-5 * (stats.increase + stats.decrease).item()
    assert weights.shape == batch.logps.shape


def test_opefo_fixed_lambda_and_sides():
    batch = _batch(seed=7)
    flow = entropy_flow(batch.logps, batch.entropies, batch.advantages)
    weights = OPEFO(fixed_lambda=0.001, sides="increase_only").rollout_weights(batch)
    torch.testing.assert_close(weights[flow > 0], torch.full_like(weights[flow > 0], 1.001))
    assert torch.all(weights[flow <= 0] == 1.0)
    assert torch.all(OPEFO(fixed_lambda=0.0).rollout_weights(batch) == 1.0)


@pytest.mark.parametrize(
    "factory,match",
    [
        (lambda: OPEFO(estimate="exact"), "Unknown entropy-flow estimate"),
        (lambda: OPEFO(fixed_lambda=1.5), r"\[-1, 1\]"),
        (lambda: OPEFO(sides="up"), "opefo_sides"),
        (lambda: PAR(coef=1.2), r"par_coef must lie in \[0, 1\]"),
        (lambda: PAR(coef_step=0.0), "par_coef_step"),
        (lambda: ClipCov(ratio=0.0), "clip_cov_ratio"),
        (lambda: ClipCov(lower=5.0, upper=1.0), "clip_cov_lb must be < clip_cov_ub"),
        (lambda: KLCov(ratio=2.0), "kl_cov_ratio"),
        (lambda: KLCov(coef=-1.0), "kl_cov_coef"),
    ],
)
def test_invalid_coefficients_are_rejected(factory, match):
    with pytest.raises(ValueError, match=match):
        factory()
