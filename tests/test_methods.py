import dataclasses
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from opefo_trl.entropy_flow import entropy_flow, flow_stats, token_weights
from opefo_trl.methods import (
    OPEFO,
    PAR,
    REGIME_GUARD,
    TOKEN_METHODS,
    ClipCov,
    KLCov,
    TokenBatch,
    TokenMethod,
    TokenTerms,
    build_token_method,
    covariance_scores,
    methods_table,
    register_token_method,
    setting,
)


def _batch(seed=0, b=4, t=50, old_shift=None):
    gen = torch.Generator().manual_seed(seed)
    logps = -torch.rand(b, t, generator=gen) * 6
    adv = torch.randn(b, generator=gen)[:, None].expand(b, t) * 3
    factor = torch.ones(b, t)
    factor[0, -7:] = 0  # padding
    old = None if old_shift is None else logps - old_shift(gen, b, t)
    entropies = torch.rand(b, t, generator=gen) * 2
    flow = entropy_flow(logps, entropies, adv)
    return TokenBatch(logps=logps, entropies=entropies, advantages=adv, factor=factor, flow=flow, old_logps=old)


def test_registry_lists_every_method_and_unknown_names_list_the_valid_ones():
    assert set(TOKEN_METHODS) >= {"grpo", "opefo", "par", "clip_cov", "kl_cov"}
    with pytest.raises(ValueError, match=r"Unknown method 'opfeo'\. Valid methods: clip_cov, grpo, kl_cov, opefo, par"):
        build_token_method("opfeo")


def test_a_new_method_plugs_in_with_its_own_settings():
    @dataclass
    class ScaleSettings:
        test_scale: float = setting(0.5, "weight of every token")

        def __post_init__(self):
            if self.test_scale < 0:
                raise ValueError("test_scale must be >= 0")

    @register_token_method("_test_scale")
    class Scale(TokenMethod):
        Settings = ScaleSettings

        def micro_batch_terms(self, batch, logps, reduce_sum=lambda x: x):
            return TokenTerms(weights=torch.full_like(batch.logps, self.settings.test_scale))

    try:
        batch = _batch()
        assert build_token_method("_test_scale").micro_batch_terms(batch, batch.logps).weights.unique().item() == 0.5
        assert Scale(test_scale=0.25).micro_batch_terms(batch, batch.logps).weights.unique().item() == 0.25

        @dataclass
        class Config(ScaleSettings):
            unrelated: int = 3

        assert Scale.from_config(Config(test_scale=0.75)).settings.test_scale == 0.75
        with pytest.raises(ValueError, match=r"test_scale must be >= 0"):
            Scale.from_config(Config(test_scale=-1.0))
        with pytest.raises(ValueError, match=r"reads the settings \['test_scale'\].*OPEFOConfig, ScaleSettings"):
            Scale.from_config(object())
        with pytest.raises(ValueError, match="already registered"):
            register_token_method("_test_scale")(Scale)
    finally:
        TOKEN_METHODS.pop("_test_scale")


def test_settings_are_built_by_keyword_and_a_settings_object_excludes_keywords():
    assert PAR(par_coef=0.3, par_coef_step=0.1).settings == PAR.Settings(par_coef=0.3, par_coef_step=0.1)
    with pytest.raises(TypeError, match="not both"):
        PAR(PAR.Settings(), par_coef=0.3)
    with pytest.raises(TypeError):
        PAR(0.3)  # positional values are refused: a reordered field cannot silently swap settings
    for method in TOKEN_METHODS.values():  # every built-in setting has help text
        assert all(f.metadata.get("help") for f in dataclasses.fields(method.Settings))


def test_covariance_scores_use_means_over_valid_tokens():
    batch = _batch()
    m = batch.factor.bool()
    expected = (batch.advantages - batch.advantages[m].mean()) * (batch.logps - batch.logps[m].mean())
    torch.testing.assert_close(covariance_scores(batch), expected)


def test_clip_cov_drops_exactly_the_budget_inside_the_window_and_never_ppo_clipped_tokens():
    # Half of the tokens get a ratio far outside [0.8, 1.2]: those in the clipped direction must never be picked.
    batch = _batch(seed=1, old_shift=lambda g, b, t: (torch.rand(b, t, generator=g) > 0.5) * 1.0)
    method = ClipCov(clip_cov_ratio=0.05, clip_cov_lb=0.5, clip_cov_ub=4.0, epsilon_low=0.2, epsilon_high=0.2)
    cov = covariance_scores(batch)
    clipped = method.ppo_clipped(batch)
    window = batch.in_loss & (cov > 0.5) & (cov < 4.0)
    assert clipped.any() and (window & ~clipped).sum() > 10
    torch.manual_seed(0)
    dropped = method.select(batch)
    n_valid = int(batch.in_loss.sum())
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
    top = cov[batch.in_loss].max().item()
    method = ClipCov(clip_cov_ratio=0.5, clip_cov_lb=top - 1e-6, clip_cov_ub=top + 1.0)  # exactly one candidate
    assert int(method.select(batch).sum()) == 1
    method = ClipCov(clip_cov_ratio=1e-9, clip_cov_lb=-1e9, clip_cov_ub=1e9)  # budget rounds down to 0: still one
    assert int(method.select(batch).sum()) == 1
    method = ClipCov(clip_cov_ratio=0.5, clip_cov_lb=1e8, clip_cov_ub=1e9)  # no candidate at all
    assert int(method.select(batch).sum()) == 0


def test_kl_cov_penalises_exactly_the_top_k_with_the_hand_derived_gradient():
    batch = _batch(seed=3, old_shift=lambda g, b, t: torch.randn(b, t, generator=g) * 0.1)
    method = KLCov(kl_cov_ratio=0.03, kl_cov_coef=2.0)
    chosen = method.select(batch)
    valid = batch.in_loss
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
    KLCov(kl_cov_ratio=0.1).micro_batch_terms(batch, logps).extra_loss.sum().backward()
    assert torch.count_nonzero(logps.grad) == 0


def test_par_scales_only_positive_advantage_tokens():
    batch = _batch(seed=5)
    batch.advantages = torch.tensor([1.5, -0.5, 0.0, 2.0])[:, None].expand_as(batch.logps)
    weights = PAR(par_coef=0.3).micro_batch_terms(batch, batch.logps).weights
    positive = batch.advantages > 0
    assert positive.any() and (~positive).any()
    torch.testing.assert_close(weights[positive], torch.full_like(weights[positive], 0.3))
    assert torch.all(weights[~positive] == 1.0)


def test_par_controller_moves_by_one_step_per_optimizer_step_within_bounds():
    par = PAR(par_coef=None, par_coef_init=0.1, par_entropy_target=0.2, par_coef_step=0.05)
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
    constant = PAR(par_coef=0.3)  # a constant coefficient is configuration: a checkpoint does not override it
    constant.load_state_dict(par.state_dict())
    assert constant.coef == 0.3


def test_par_controller_uses_the_rank_reduced_mean_entropy():
    par = PAR(par_coef=None, par_coef_init=0.5)
    par.micro_batch_terms(
        *(lambda b: (b, b.logps))(
            TokenBatch(torch.zeros(1, 2), torch.full((1, 2), 0.1), torch.ones(1, 2), torch.ones(1, 2))
        )
    )
    # Another rank saw 2 tokens of entropy 0.5: global mean (0.2 + 1.0) / 4 = 0.3 >= 0.2 -> coefficient goes up.
    par.on_optimizer_step(reduce_sum=lambda t: t + torch.tensor([1.0, 2.0], dtype=t.dtype))
    assert par.coef == pytest.approx(0.55)
    assert par.pop_metrics()["par/entropy"] == pytest.approx(0.3)


def test_par_controller_ignores_tokens_outside_the_loss():
    par = PAR(par_coef=None, par_coef_init=0.5)
    entropies = torch.tensor([[0.1, 0.1, 5.0]])
    factor = torch.tensor([[1.0, 1.0, 0.0]])  # the high-entropy token is masked out of the loss
    par.micro_batch_terms(TokenBatch(torch.zeros(1, 3), entropies, torch.ones(1, 3), factor), torch.zeros(1, 3))
    par.on_optimizer_step()
    assert par.pop_metrics()["par/entropy"] == pytest.approx(0.1)
    assert par.coef == pytest.approx(0.45)


def test_opefo_rollout_weights_balance_the_flow_and_report_metrics():
    batch = _batch(seed=6)
    method = OPEFO()
    weights = method.rollout_weights(batch)
    stats = flow_stats(batch.flow, batch.factor)
    method.on_optimizer_step()
    metrics = method.pop_metrics()
    assert metrics["opefo/lambda"] == pytest.approx(stats.lambda_star.item())
    assert metrics["opefo/lambda_applied"] == pytest.approx(stats.lambda_star.item())
    assert abs(metrics["opefo/weighted_net"]) < 1e-5 * (stats.increase + stats.decrease).item()
    assert not any(name.startswith("entropy_flow/") for name in metrics)  # the diagnostics' prefix is not OPEFO's
    assert weights.shape == batch.logps.shape
    method.on_optimizer_step()  # a second optimizer step on the same rollout batch (off-policy opt-in) logs it too
    assert method.pop_metrics() == metrics


def test_opefo_balances_the_factor_weighted_flow():
    batch = _batch(seed=8)
    batch.factor = torch.rand(batch.factor.shape, generator=torch.Generator().manual_seed(0)) * batch.factor
    batch.factor[1] = 0.0  # a sequence the loss drops
    weights = OPEFO().rollout_weights(batch)
    effective = (batch.factor * weights * batch.flow).double().sum()
    gross = (batch.factor * batch.flow.abs()).double().sum()
    assert abs(effective.item()) <= 1e-6 * gross.item()
    unweighted = (batch.factor * batch.flow).double().sum()
    assert abs(unweighted.item()) > 1e-3 * gross.item()


def test_opefo_step_balance_takes_the_root_of_the_step_change():
    """opefo_balance='step': lambda is where the step model's first-order change is 0, not the paper's lambda*."""
    batch = _batch(seed=8)
    calls = []

    def step_change(lam):  # smooth, nonlinear in lambda (Adam's moments), root at 0.2
        calls.append(lam)
        return 3e-3 * (lam - 0.2) + 1e-3 * (lam**3 - 0.2**3)

    method = OPEFO(opefo_balance="step")
    weights = method.rollout_weights(dataclasses.replace(batch, step_change=step_change))
    method.on_optimizer_step()
    metrics = method.pop_metrics()
    assert metrics["opefo/lambda_applied"] == pytest.approx(0.2, abs=1e-7)
    assert abs(metrics["opefo/step_change"]) <= 1e-7 * abs(metrics["opefo/step_change_unweighted"])
    assert metrics["opefo/step_change_unweighted"] == pytest.approx(step_change(0.0))
    assert metrics["opefo/lambda"] == pytest.approx(flow_stats(batch.flow, batch.factor).lambda_star.item())
    torch.testing.assert_close(weights, token_weights(batch.flow, metrics["opefo/lambda_applied"]))
    assert len(calls) < 20
    with pytest.raises(ValueError, match="step model"):
        OPEFO(opefo_balance="step").rollout_weights(batch)


def test_opefo_step_balance_without_a_root_in_reach_takes_the_better_end_and_warns_once():
    batch = _batch(seed=8)
    for change, end in ((lambda lam: -1.0 + 0.1 * lam, 1.0), (lambda lam: 1.0 + 0.1 * lam, -1.0)):
        method = OPEFO(opefo_balance="step")
        with pytest.warns(UserWarning, match=r"no lambda in \[-1, 1\] zeroes the first-order entropy change"):
            weights = method.rollout_weights(dataclasses.replace(batch, step_change=change))
        method.on_optimizer_step()
        assert method.pop_metrics()["opefo/lambda_applied"] == end
        assert weights.min() >= 0.0
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            method.rollout_weights(dataclasses.replace(batch, step_change=change))  # warned once


def test_opefo_weight_signs_make_the_weights_affine_in_lambda():
    batch = _batch(seed=3)
    for sides in ("both", "increase_only", "decrease_only"):
        method = OPEFO(opefo_sides=sides)
        signs = method.weight_signs(batch)
        for lam in (-0.7, 0.003, 1.0):
            torch.testing.assert_close(token_weights(batch.flow, lam, sides), 1.0 + lam * signs)
    assert TokenMethod().weight_signs(batch) is None and not TokenMethod().needs_step_model


@pytest.mark.parametrize("empty", ["increase", "decrease"])
def test_a_one_sided_batch_warns_once_with_the_figures(empty):
    """P = 0 or N = 0: lambda* = +/-1 zeroes the other side's weights; the user is told at the first occurrence."""
    batch = _batch(seed=9)
    batch.flow = -batch.flow.abs() if empty == "increase" else batch.flow.abs()
    method = OPEFO()
    with pytest.warns(UserWarning, match=r"is empty: P=.*N=.*gives every S. token weight 0") as caught:
        weights = method.rollout_weights(batch)
    assert ("S+ is empty" in str(caught[0].message)) == (empty == "increase")
    assert weights.abs().max() == 0.0  # every token carries flow, every one gets weight 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        method.rollout_weights(batch)  # warned once


def test_opefo_needs_the_flow():
    batch = _batch()
    batch.flow = None
    with pytest.raises(ValueError, match="TokenBatch.flow"):
        OPEFO().rollout_weights(batch)


def test_opefo_fixed_lambda_and_sides():
    batch = _batch(seed=7)
    flow = batch.flow
    weights = OPEFO(opefo_lambda=0.001, opefo_sides="increase_only").rollout_weights(batch)
    torch.testing.assert_close(weights[flow > 0], torch.full_like(weights[flow > 0], 1.001))
    assert torch.all(weights[flow <= 0] == 1.0)
    assert torch.all(OPEFO(opefo_lambda=0.0).rollout_weights(batch) == 1.0)


def test_regime_guard_warns_once_when_lambda_stays_large():
    method = OPEFO(opefo_lambda_warn=0.1)
    batch = _batch(seed=9)
    batch.flow = -batch.flow.abs()  # every token decreases entropy: lambda* = 1
    for _ in range(OPEFO.REGIME_WINDOW - 1):
        method.rollout_weights(batch)
        assert method.regime_warning() is None  # fewer than 20 steps: no verdict yet
    method.rollout_weights(batch)
    message = method.regime_warning()
    assert "averaged over the last 20 optimizer steps is 1" in message and "entropy_flow_estimate='param'" in message
    assert "entropy_flow_audit_steps" in message
    method.rollout_weights(batch)
    assert method.regime_warning() is None  # once


def test_regime_guard_warns_once_when_entropy_climbs_far_above_its_start():
    """The second trigger: the rollout's mean token entropy above 1.2x the first rollout's (the divergence the demo
    diagnosed happened with |lambda*| ~ 0.04, where the lambda trigger stays quiet). The advice follows the
    estimate: the tabular one is told why it can mislead, `param` with the batch balance is sent to the step balance."""
    batch = _batch(seed=9)
    for estimate, says in (("opefo", "(no factor pi)"), ("param", "opefo_balance='step', which zeroes")):
        method = OPEFO(flow_estimate=estimate)
        method.rollout_weights(batch)
        assert method.regime_warning() is None
        method.rollout_weights(dataclasses.replace(batch, entropies=batch.entropies * 1.15))  # healthy runs peak here
        assert method.regime_warning() is None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the one-sided warning does not apply; nothing else may warn here)
            method.rollout_weights(dataclasses.replace(batch, entropies=batch.entropies * 1.3))
        message = method.regime_warning()
        assert message.startswith(REGIME_GUARD) and "1.30x the first rollout's" in message and says in message
        method.rollout_weights(dataclasses.replace(batch, entropies=batch.entropies * 2.0))
        assert method.regime_warning() is None  # once


def test_regime_guard_stays_quiet_in_the_paper_regime():
    method = OPEFO()
    gen = torch.Generator().manual_seed(1)
    flow = torch.randn(8, 64, generator=gen)
    flow = flow - flow.mean()  # a balanced flow: lambda* ~ 0
    batch = TokenBatch(flow, flow.abs(), torch.ones_like(flow), torch.ones_like(flow), flow=flow)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3 * OPEFO.REGIME_WINDOW):
            method.rollout_weights(batch)
            assert method.regime_warning() is None


@pytest.mark.parametrize(
    "factory,match",
    [
        (lambda: OPEFO(opefo_lambda=1.5), r"\[-1, 1\]"),
        (lambda: OPEFO(opefo_sides="up"), "opefo_sides"),
        (lambda: OPEFO(opefo_lambda_warn=0.0), "opefo_lambda_warn"),
        (lambda: PAR(par_coef=1.2), r"par_coef must lie in \[0, 1\]"),
        (lambda: PAR(par_coef_step=0.0), "par_coef_step"),
        (lambda: ClipCov(clip_cov_ratio=0.0), "clip_cov_ratio"),
        (lambda: ClipCov(clip_cov_lb=5.0, clip_cov_ub=1.0), "clip_cov_lb must be < clip_cov_ub"),
        (lambda: KLCov(kl_cov_ratio=2.0), "kl_cov_ratio"),
        (lambda: KLCov(kl_cov_coef=-1.0), "kl_cov_coef"),
        (lambda: OPEFO(estimate="opefo"), "unexpected keyword"),
    ],
)
def test_invalid_settings_are_rejected(factory, match):
    with pytest.raises((ValueError, TypeError), match=match):
        factory()


# ----------------------------------------------------------------------------------------------------------------------
# The methods table: one source (the method classes), one copy (the README)
# ----------------------------------------------------------------------------------------------------------------------

README = Path(__file__).resolve().parent.parent / "README.md"
TABLE_START, TABLE_END = "<!-- methods table:", "<!-- end of methods table -->"


def test_the_methods_table_lists_every_registered_method_first_the_default():
    table = methods_table()
    rows = table.splitlines()[2:]
    assert rows[0].startswith("| OPEFO (default) |")
    for name in TOKEN_METHODS:  # every method has a row that selects it by name
        assert f'`method="{name}"`' in table, name
    assert "`clip_cov_ratio=0.0002`, `clip_cov_lb=1`, `clip_cov_ub=5`" in table  # the settings' own defaults

    @register_token_method("_test_unlisted")
    class Unlisted(TokenMethod):  # no rows of its own: one naming it, never GRPO's inherited ones
        @dataclass
        class Settings:
            unlisted_strength: float = setting(0.5, "strength")

    try:
        rows = methods_table([Unlisted]).splitlines()[2:]
        assert rows == ['| Unlisted | `method="_test_unlisted"` (`unlisted_strength=0.5`) |']
        assert '`method="_test_unlisted"`' in methods_table()
    finally:
        TOKEN_METHODS.pop("_test_unlisted")


def test_the_readme_holds_the_methods_table_of_the_method_classes():
    text = README.read_text()
    start = text.index("\n", text.index(TABLE_START)) + 1
    copy = text[start : text.index(TABLE_END)].strip()
    assert copy == methods_table(), (
        "README.md's methods table differs from the method classes' rows: replace it with the output of "
        f"`python -m opefo_trl.methods`:\n{methods_table()}"
    )


def test_the_flag_of_earlier_releases_is_refused_rather_than_ignored():
    with pytest.raises(TypeError, match=r"on_policy_only is no longer read: refuse off-policy configurations in"):

        @register_token_method("_test_old_flag")
        class OldFlag(TokenMethod):
            on_policy_only = True

    assert "_test_old_flag" not in TOKEN_METHODS
