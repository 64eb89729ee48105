import math

import pytest
import torch

from opefo_trl.maths.entropy_flow import (
    FLOW_ESTIMATES,
    FlowStats,
    entropy_flow,
    flow_per_unit_advantage,
    flow_stats,
    on_policy_mean,
    token_weights,
)

pytestmark = pytest.mark.numerics


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits, -1)
    return -(logp.exp() * logp).sum(-1)


def _softmax_quantities(logits: torch.Tensor, action: int):
    logp = torch.log_softmax(logits, -1)
    p = logp.exp()
    gap = logp + _entropy(logits)
    return dict(
        logps=logp[action].reshape(1, 1),
        entropies=_entropy(logits).reshape(1, 1),
        moment2=(p**2 * gap).sum().reshape(1, 1),
        moment3=(p**3 * gap).sum().reshape(1, 1),
    )


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("advantage", [1.0, -0.7])
def test_full_estimate_matches_exact_entropy_change_of_a_small_step(seed, advantage):
    """A PG step dz = eta A (e_a - pi) changes H by eta * d_t to first order (docs/algorithm.md section 1)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(50, generator=gen, dtype=torch.float64) * 2
    action = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
    eta = 1e-4
    q = _softmax_quantities(logits, action)
    flow = entropy_flow(
        q["logps"],
        q["entropies"],
        torch.tensor([advantage], dtype=torch.float64),
        "full",
        q["moment2"],
        q["moment3"],
    )
    pi = torch.softmax(logits, -1)
    step = eta * advantage * (torch.nn.functional.one_hot(torch.tensor(action), 50).double() - pi)
    exact = _entropy(logits + step) - _entropy(logits)
    predicted = eta * flow.double().item()
    assert abs(predicted - exact.item()) / abs(exact.item()) < 1e-3


@pytest.mark.parametrize("seed", range(3))
def test_onaction_is_the_move_of_the_sampled_logit_and_opefo_its_log_prob_change_times_the_surprise_gap(seed):
    """What the two tabular approximations are (docs/algorithm.md section 1), against exact changes of a 50-way
    softmax: moving only the sampled logit by dz_a = eta A (1 - pi_a) changes H by eta * onaction and log pi_a by
    eta A (1 - pi_a)^2; opefo is -(log pi_a + H) times that log-prob change, i.e. onaction * (1 - pi_a) / pi_a."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(50, generator=gen, dtype=torch.float64) * 2
    action = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
    eta, advantage = 1e-6, torch.tensor([0.8], dtype=torch.float64)
    q = _softmax_quantities(logits, action)
    pi = float(q["logps"].exp())
    onaction, opefo = (
        entropy_flow(q["logps"], q["entropies"], advantage, e).double().item() for e in ("onaction", "opefo")
    )
    moved = logits.clone()
    moved[action] += eta * float(advantage) * (1 - pi)
    assert (_entropy(moved) - _entropy(logits)).item() / eta == pytest.approx(onaction, rel=1e-4)
    log_prob_change = (torch.log_softmax(moved, -1)[action] - torch.log_softmax(logits, -1)[action]).item() / eta
    assert log_prob_change == pytest.approx(float(advantage) * (1 - pi) ** 2, rel=1e-4)
    surprise_gap = (q["logps"] + q["entropies"]).item()
    assert opefo == pytest.approx(-surprise_gap * log_prob_change, rel=1e-4)
    assert opefo == pytest.approx(onaction * (1 - pi) / pi, rel=1e-5)


def test_cheap_estimates_share_the_sign_and_differ_in_magnitude():
    gen = torch.Generator().manual_seed(0)
    logps = -torch.rand(4, 7, generator=gen) * 5
    entropies = torch.rand(4, 7, generator=gen) * 3
    advantages = torch.tensor([1.0, -1.0, 0.5, -2.0])
    flows = {name: entropy_flow(logps, entropies, advantages, name) for name in ("opefo", "onaction", "sign")}
    for name in ("opefo", "onaction"):
        assert torch.equal(flows[name].sign(), flows["sign"].sign())
    pi = logps.exp()
    expected = -advantages[:, None] * (1 - pi) ** 2 * (logps + entropies)
    torch.testing.assert_close(flows["opefo"], expected)
    torch.testing.assert_close(flows["onaction"], -advantages[:, None] * pi * (1 - pi) * (logps + entropies))


def test_flow_stats_and_lambda_star_on_a_hand_built_batch():
    flow = torch.tensor([[0.3, -0.1, 0.0], [-0.5, 0.2, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # the 9.0 is padding
    stats = flow_stats(flow, mask)
    assert stats.increase.item() == pytest.approx(0.5)
    assert stats.decrease.item() == pytest.approx(0.6)
    assert stats.tokens.item() == 5 and stats.increase_tokens.item() == 2 and stats.decrease_tokens.item() == 2
    assert stats.lambda_star.item() == pytest.approx((0.6 - 0.5) / 1.1)
    metrics = stats.metrics()
    assert metrics["entropy_flow/net"] == pytest.approx(-0.1)
    assert metrics["entropy_flow/increase_token_frac"] == pytest.approx(0.4)


def test_stats_add_like_one_batch():
    gen = torch.Generator().manual_seed(1)
    flow, mask = torch.randn(6, 5, generator=gen), (torch.rand(6, 5, generator=gen) > 0.3).long()
    whole = flow_stats(flow, mask).to_tensor()
    parts = flow_stats(flow[:2], mask[:2]) + flow_stats(flow[2:], mask[2:])
    torch.testing.assert_close(parts.to_tensor(), whole)
    torch.testing.assert_close(FlowStats.from_tensor(whole).to_tensor(), whole)


@pytest.mark.parametrize("estimate", ["opefo", "onaction", "sign"])
def test_reweighting_with_lambda_star_zeroes_the_net_flow(estimate):
    gen = torch.Generator().manual_seed(3)
    logps = -torch.rand(16, 40, generator=gen) * 4
    entropies = torch.rand(16, 40, generator=gen) * 2
    advantages = torch.randn(16, generator=gen)
    mask = (torch.rand(16, 40, generator=gen) > 0.2).float()
    flow = entropy_flow(logps, entropies, advantages, estimate)
    stats = flow_stats(flow, mask)
    assert abs(stats.net.item()) > 1e-3  # the unweighted batch does move entropy
    weights = token_weights(flow, stats.lambda_star)
    assert weights.dtype == torch.float32 and not weights.requires_grad
    weighted_net = (flow.double() * weights.double() * mask).sum()
    gross = (flow.abs() * mask).sum()
    assert abs(weighted_net.item()) <= 1e-6 * gross.item()


def test_sides_rescale_only_one_set():
    flow = torch.tensor([[0.5, -0.5, 0.0]])
    assert token_weights(flow, 0.2, "both")[0].tolist() == pytest.approx([1.2, 0.8, 1.0])
    assert token_weights(flow, 0.2, "increase_only")[0].tolist() == pytest.approx([1.2, 1.0, 1.0])
    assert token_weights(flow, 0.2, "decrease_only")[0].tolist() == pytest.approx([1.0, 0.8, 1.0])
    with pytest.raises(ValueError, match="sides"):
        token_weights(flow, 0.2, "left")


def _lambda_and_weights(logps, entropies, advantages, mask):
    flow = entropy_flow(logps, entropies, advantages)
    lam = flow_stats(flow, mask).lambda_star
    return lam, token_weights(flow, lam)


@pytest.mark.parametrize(
    "case",
    ["all_advantages_zero", "one_token", "all_increasing", "all_decreasing", "mask_all_zero"],
)
def test_degenerate_batches_give_finite_lambda_and_weights(case):
    logps = torch.log(torch.tensor([[0.9, 0.8, 0.95]]))
    entropies = torch.tensor([[0.2, 0.3, 0.1]])  # log pi + H > 0 everywhere: sign follows -A
    advantages, mask = torch.tensor([1.0]), torch.ones(1, 3)
    if case == "all_advantages_zero":
        advantages = torch.tensor([0.0])
    elif case == "one_token":
        logps, entropies, mask = logps[:, :1], entropies[:, :1], mask[:, :1]
    elif case == "all_increasing":
        advantages = torch.tensor([-1.0])
    elif case == "mask_all_zero":
        mask = torch.zeros(1, 3)
    lam, weights = _lambda_and_weights(logps, entropies, advantages, mask)
    assert math.isfinite(lam.item()) and torch.isfinite(weights).all()
    assert -1.0 <= lam.item() <= 1.0 and (weights >= 0).all()
    if case in ("all_advantages_zero", "mask_all_zero"):
        assert lam.item() == 0.0
    if case == "all_increasing":
        assert lam.item() == -1.0  # S+ is damped to 0: nothing may raise entropy without a balancing decrease
    if case in ("all_decreasing", "one_token"):
        assert lam.item() == 1.0


def test_unknown_estimate_and_missing_statistics_are_clear_errors():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="Unknown entropy-flow estimate 'exact'"):
        entropy_flow(x, x, torch.ones(1), "exact")
    with pytest.raises(ValueError, match="full.*moment2"):
        entropy_flow(x, x, torch.ones(1), "full")
    with pytest.raises(ValueError, match="opefo_centered.*moment2 and moment3"):
        entropy_flow(x, x, torch.ones(1), "opefo_centered", x)
    with pytest.raises(ValueError, match="param.*entropy_alignment"):
        entropy_flow(x, x, torch.ones(1), "param")
    assert set(FLOW_ESTIMATES) == {"opefo", "opefo_centered", "onaction", "sign", "full", "param"}
    with pytest.raises(ValueError, match=r"shape \(B, T\)"):
        entropy_flow(torch.zeros(3), torch.zeros(3), torch.ones(3))


def test_param_flow_is_the_advantage_times_the_alignment():
    alignment = torch.tensor([[0.5, -2.0, 0.0]])
    zeros = torch.zeros(1, 3)
    flow = entropy_flow(zeros, zeros, torch.tensor([-3.0]), "param", entropy_alignment=alignment)
    assert flow.tolist() == [[-1.5, 6.0, 0.0]]


@pytest.mark.parametrize("estimate", ["opefo", "onaction", "sign"])
def test_flow_is_linear_in_the_advantage(estimate):
    gen = torch.Generator().manual_seed(7)
    logps, entropies = -torch.rand(3, 5, generator=gen) * 3, torch.rand(3, 5, generator=gen)
    advantages = torch.randn(3, 5, generator=gen)
    unit = flow_per_unit_advantage(logps, entropies, estimate)
    torch.testing.assert_close(entropy_flow(logps, entropies, advantages, estimate), advantages * unit)


def test_flow_sums_are_weighted_by_the_loss_factor():
    """P and N are sums of f_t d_t: the flow of the update the loss applies, not of every sampled token."""
    flow = torch.tensor([[0.3, -0.1, 0.4], [-0.5, 0.2, 9.0]])
    factor = torch.tensor([[2.0, 1.0, 0.0], [0.5, 0.5, 0.0]])
    stats = flow_stats(flow, factor)
    assert stats.increase.item() == pytest.approx(2 * 0.3 + 0.5 * 0.2)
    assert stats.decrease.item() == pytest.approx(0.1 + 0.5 * 0.5)
    assert stats.tokens.item() == 4 and stats.increase_tokens.item() == 2 and stats.decrease_tokens.item() == 2
    weights = token_weights(flow, stats.lambda_star)
    assert (flow.double() * weights.double() * factor.double()).sum().item() == pytest.approx(0.0, abs=1e-7)


def test_a_sequence_with_factor_zero_changes_nothing():
    gen = torch.Generator().manual_seed(11)
    flow = torch.randn(4, 6, generator=gen)
    factor = torch.rand(4, 6, generator=gen)
    factor[2] = 0.0  # e.g. a sequence whose vLLM importance weight was masked to 0
    reference = flow_stats(flow, factor).to_tensor()
    changed = flow.clone()
    changed[2] = torch.randn(6, generator=gen) * 100
    torch.testing.assert_close(flow_stats(changed, factor).to_tensor(), reference)
    torch.testing.assert_close(flow_stats(flow[[0, 1, 3]], factor[[0, 1, 3]]).to_tensor(), reference)


def _positions(batch: int, length: int, vocab: int, seed: int):
    """(B, T) positions of float64 softmaxes of different sharpness (peaked to flat), a token sampled at each, and what
    a brute-force sum over the vocabulary gives: pi, the surprise gap log pi_v + H and the moments S_2, S_3."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-1, 1.2, batch * length, dtype=torch.float64).reshape(batch, length, 1)
    logits = torch.randn(batch, length, vocab, generator=gen, dtype=torch.float64) * scale
    logp = torch.log_softmax(logits, -1)
    p = logp.exp()
    entropy = -(p * logp).sum(-1)
    gap = logp + entropy.unsqueeze(-1)
    actions = torch.multinomial(p.reshape(-1, vocab), 1, generator=gen).reshape(batch, length, 1)
    return dict(
        p=p,
        logp=logp,
        entropy=entropy,
        gap=gap,
        moment2=(p**2 * gap).sum(-1),
        moment3=(p**3 * gap).sum(-1),
        actions=actions,
    )


def _every_token_u(estimate: str, q: dict) -> torch.Tensor:
    """u_v for every token v each position could sample, (B, T, V), from the estimate's own formula in float64."""
    p, gap = q["p"], q["gap"]
    if estimate == "opefo":
        return -((1 - p) ** 2) * gap
    if estimate == "onaction":
        return -p * (1 - p) * gap
    if estimate == "sign":
        return -gap
    if estimate in ("full",):
        return -(p * gap - q["moment2"].unsqueeze(-1))
    raise AssertionError(estimate)


# Inputs go to float32 inside the library: a result of size ~|S_2| + |S_3| + E|u| carries a few float32 ulps of it.
_EPS32 = torch.finfo(torch.float32).eps


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("estimate", ["opefo", "onaction", "sign", "full"])
def test_on_policy_mean_is_the_brute_force_expectation_over_the_vocabulary(estimate, seed):
    """E_{a~pi}[u_a] = 2 S_2 - S_3 (opefo), S_3 - S_2 (onaction), 0 (sign, full), position by position."""
    q = _positions(3, 5, 60, seed)
    u = _every_token_u(estimate, q)
    expected = (q["p"] * u).sum(-1)
    got = on_policy_mean(estimate, q["moment2"], q["moment3"]).double()
    scale = q["moment2"].abs() + q["moment3"].abs() + (q["p"] * u.abs()).sum(-1)
    assert got.shape == (3, 5)
    assert ((got - expected).abs() <= 8 * _EPS32 * scale).all()
    if estimate == "opefo":  # Cov_pi(pi (2 - pi), log pi) >= 0: larger pi, larger log pi
        assert (expected >= -1e-12).all() and (got > 0).any()
    if estimate == "onaction":
        assert (expected <= 1e-12).all()


@pytest.mark.parametrize("seed", range(4))
def test_opefo_centered_is_opefo_less_its_on_policy_mean_at_each_position(seed):
    """u_t - E_pi[u] with the mean taken at the token's own position (not over the batch), for the token sampled there,
    against the float64 brute force; and its on-policy mean is zero to rounding."""
    q = _positions(3, 5, 60, seed)
    u_opefo = _every_token_u("opefo", q)
    u_every = u_opefo - (q["p"] * u_opefo).sum(-1, keepdim=True)  # (B, T, V)
    sampled_logp = q["logp"].gather(-1, q["actions"]).squeeze(-1)
    got = flow_per_unit_advantage(sampled_logp, q["entropy"], "opefo_centered", q["moment2"], q["moment3"]).double()
    expected = u_every.gather(-1, q["actions"]).squeeze(-1)
    scale = q["moment2"].abs() + q["moment3"].abs() + u_opefo.abs().amax(-1)
    assert ((got - expected).abs() <= 8 * _EPS32 * scale).all()
    # Its on-policy mean: every token each position could sample, through the library's own formula.
    vocab = q["p"].shape[-1]
    every = flow_per_unit_advantage(
        q["logp"].reshape(-1, vocab),
        q["entropy"].reshape(-1, 1).expand(-1, vocab),
        "opefo_centered",
        q["moment2"].reshape(-1, 1).expand(-1, vocab),
        q["moment3"].reshape(-1, 1).expand(-1, vocab),
    ).double()
    mean = (q["p"].reshape(-1, vocab) * every).sum(-1)
    spread = (q["p"].reshape(-1, vocab) * every.abs()).sum(-1)
    assert (mean.abs() <= 8 * _EPS32 * (spread + scale.reshape(-1))).all()
    assert (spread > 0).all()


def test_flow_stats_split_lambda_star_into_the_bias_part_and_the_rest():
    """lambda* = lambda_bias + lambda_net_of_bias, lambda_bias = -sum f A E[u] / (P + N), summed with the factor."""
    flow = torch.tensor([[0.5, -2.0, 1.0, 3.0]])
    factor = torch.tensor([[1.0, 1.0, 0.5, 0.0]])
    bias = torch.tensor([[0.2, 0.1, -0.4, 9.0]])  # the last token is out of the loss
    stats = flow_stats(flow, factor, bias)
    assert float(stats.bias_net) == pytest.approx(0.2 + 0.1 - 0.2)
    total = 0.5 + 2.0 + 0.5
    assert float(stats.lambda_bias) == pytest.approx(-0.1 / total)
    metrics = stats.metrics()
    assert metrics["entropy_flow/lambda_bias"] + metrics["entropy_flow/lambda_net_of_bias"] == pytest.approx(
        metrics["entropy_flow/lambda"]
    )
    assert metrics["entropy_flow/bias_net"] == pytest.approx(0.1)
    summed = FlowStats.from_tensor(stats.to_tensor() + stats.to_tensor())
    assert float(summed.bias_net) == pytest.approx(0.2)
    plain = flow_stats(flow, factor)
    assert plain.bias_net is None and "entropy_flow/lambda_bias" not in plain.metrics()
    with pytest.raises(ValueError, match="bias_net"):
        _ = stats + plain
