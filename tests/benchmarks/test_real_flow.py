"""benchmarks/real_flow.py: the figures of one rollout from its per-token statistics, against a full softmax (no model:
the real-model run itself is the tier's, `python benchmarks/real_flow.py`)."""

import pytest
import torch
from conftest import load_benchmark

real_flow = load_benchmark("real_flow")


def micro_batch(seed, rows=4, length=6, vocab=50):
    """A micro-batch's recorded statistics from peaked random logits and tokens sampled from them (with the softmax
    and the tokens), three advantages and a zero, padding, and a made-up `param` flow."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, length, vocab, generator=gen, dtype=torch.float64) * 3
    logp_all = logits.log_softmax(-1)
    tokens = torch.multinomial(logp_all.exp().flatten(0, 1), 1, generator=gen).view(rows, length)
    logps = logp_all.gather(-1, tokens[..., None])[..., 0]
    probs = logp_all.exp()
    factor = torch.ones(rows, length, dtype=torch.float64)
    factor[0, -2:] = 0  # padding
    return dict(
        logps=logps,
        entropies=-(probs * logp_all).sum(-1),
        advantages=torch.tensor([1.0, -1.0, 0.0, 0.5], dtype=torch.float64)[:, None].expand(rows, length),
        factor=factor / factor.sum(),
        param=torch.randn(rows, length, generator=gen, dtype=torch.float64),
        moment2=(probs**2 * (logp_all - (probs * logp_all).sum(-1, keepdim=True))).sum(-1).float(),
        moment3=(probs**3 * (logp_all - (probs * logp_all).sum(-1, keepdim=True))).sum(-1).float(),
        trl_logps=logps,
    ), (probs, tokens)


def test_a_rollouts_figures_are_those_of_the_full_softmax():
    parts, softmaxes = zip(*(micro_batch(seed) for seed in (1, 2)), strict=True)
    figures = real_flow.rollout_figures(list(parts))

    def joined(key):
        return torch.cat([part[key].flatten() for part in parts])

    logps, advantages, factor = joined("logps"), joined("advantages"), joined("factor")
    pi = logps.exp()
    # `full` from its definition: u_t = sum_k dH/dz_k (e_a - pi)_k, dH/dz_k = -pi_k (log pi_k + H)
    probs = torch.cat([p.flatten(0, 1) for p, _ in softmaxes])
    tokens = torch.cat([t.flatten() for _, t in softmaxes])
    dh_dz = -probs * (probs.log() + joined("entropies")[:, None])
    full = dh_dz[torch.arange(len(pi)), tokens] - (dh_dz * probs).sum(-1)
    expected = {"full": full, "param": joined("param"), "opefo": -((1 - pi) ** 2) * (logps + joined("entropies"))}
    rare = (pi < real_flow.LOW_PROB) & (factor > 0)
    moving = (factor > 0) & (advantages != 0)
    assert rare.any() and (~rare & moving).any()
    for estimate, unit in expected.items():
        flow = factor * advantages * unit
        increase, decrease = flow.clamp(min=0).sum(), -flow.clamp(max=0).sum()
        lam = float((decrease - increase) / (decrease + increase))
        row = figures["estimates"][estimate]
        assert row["lambda_star"] == pytest.approx(lam, abs=1e-5)
        assert row["increase"] == pytest.approx(float(increase), rel=1e-5)
        # the reweighted flow: 1 + lambda* on S+, 1 - lambda* on S-
        moved = (flow * (1 + lam * flow.sign())).abs()
        assert row["low_prob_share"] == pytest.approx(float(moved[rare].sum() / moved.sum()), rel=1e-5)
        agree = ((advantages * unit).sign() == (advantages * joined("param")).sign())[moving].double().mean()
        assert row["sign_agreement"] == pytest.approx(float(agree))
        kept = flow.where(~rare, 0.0)
        without = (-kept.clamp(max=0).sum() - kept.clamp(min=0).sum()) / kept.abs().sum()
        assert row["lambda_without_rare"] == pytest.approx(float(without), abs=1e-5)
    assert figures["estimates"]["param"]["sign_agreement"] == 1.0
    assert figures["tokens"] == int((factor > 0).sum()) and figures["rare_tokens"] == int(rare.sum())


def test_bad_settings_are_refused_in_one_line(capsys):
    assert real_flow.main(["--preconditioner", "sgd"]) == 2
    assert "--preconditioner is 'adam' or 'none'; got 'sgd'." in capsys.readouterr().err
