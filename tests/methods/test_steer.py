"""STEER: weights from the size of each token's entropy flow, exp and linear, the floors, over ranks; the STEER code's
Omega and per-micro-batch scope against an independent float64 re-implementation of its formula. The weights are
computed in float64 and returned in float32 (relative rounding 2^-24 = 6e-8): the hand values are met to 1e-6."""

import math

import pytest
import torch
from methods_batch import random_batch, run_ranks, split_rows

from opefo_trl.methods import STEER, TokenBatch


def flow_batch(flow):
    flow = torch.tensor(flow, dtype=torch.float64)
    factor = torch.ones_like(flow)
    factor[0, -1] = 0  # padding: its flow is outside every max and min
    return TokenBatch(
        logps=torch.zeros_like(flow),
        entropies=torch.ones_like(flow),
        advantages=torch.ones_like(flow),
        factor=factor,
        flow=flow,
    )


@pytest.mark.numerics
def test_steer_exp_gives_the_largest_change_the_floor_and_no_change_weight_one():
    # |d| = 0.1, 0.4, 0, 0.2 in the loss: k = -ln 0.8 / 0.4, so w = 0.8 ** (|d| / 0.4).
    method = STEER(steer_weight_min=0.8)
    weights = method.rollout_weights(flow_batch([[0.1, -0.4, 0.0, 0.2, 9.0]])).weights
    expected = torch.tensor([[0.8**0.25, 0.8, 1.0, 0.8**0.5]], dtype=torch.float64)
    torch.testing.assert_close(weights[:, :4].double(), expected, rtol=1e-6, atol=0)  # float32 weights
    metrics = method.pop_metrics()
    assert metrics["steer/omega_max"] == pytest.approx(0.4)
    assert metrics["steer/floor_frac"] == pytest.approx(1 / 4)
    assert metrics["steer/weight_mean"] == pytest.approx(float(expected.mean()), rel=1e-6)


@pytest.mark.numerics
def test_steer_exp_does_not_stretch_a_batch_of_small_changes_to_the_floor():
    # Largest |d| 0.01 < floor 0.02: k = -ln 0.8 / 0.02, so w = 0.8 ** (|d| / 0.02).
    weights = STEER(steer_weight_min=0.8).rollout_weights(flow_batch([[0.01, -0.005, 0.0]])).weights
    expected = torch.tensor([[0.8**0.5, 0.8**0.25]], dtype=torch.float64)
    torch.testing.assert_close(weights[:, :2].double(), expected, rtol=1e-6, atol=0)


@pytest.mark.numerics
def test_steer_linear_maps_the_changes_onto_the_weight_range():
    # |d| in [0, 0.4] onto [1.2, 0.8]: w = 1.2 - |d|.
    method = STEER(steer_mapping="linear", steer_weight_min=0.8, steer_weight_max=1.2)
    weights = method.rollout_weights(flow_batch([[0.1, -0.4, 0.0, 0.2, 9.0]])).weights
    expected = torch.tensor([[1.1, 0.8, 1.2, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(weights[:, :4].double(), expected, rtol=1e-6, atol=0)
    same = method.rollout_weights(flow_batch([[0.3, -0.3, 0.3]])).weights  # every change equal: the middle weight
    torch.testing.assert_close(same[:, :2], torch.full((1, 2), 1.0))


def test_steer_over_two_ranks_scales_by_the_union_extremes():
    batch = random_batch(seed=9, b=6, t=30)
    for mapping in ("exp", "linear"):
        whole = STEER(steer_mapping=mapping).rollout_weights(batch).weights
        per_rank = run_ranks(
            lambda part, context, mapping=mapping: STEER(steer_mapping=mapping).rollout_weights(part, context).weights,
            split_rows(batch, 2),
        )
        torch.testing.assert_close(torch.cat(per_rank), whole, rtol=0, atol=0)
        alone = torch.cat([STEER(steer_mapping=mapping).rollout_weights(part).weights for part in split_rows(batch, 2)])
        assert not torch.equal(alone, whole), mapping  # each rank's own extremes differ from the union's


def authors_weights(logps, old_logps, entropies, advantages, mask, mapping, w_min=0.8, w_max=1.2, floor=0.02):
    """The STEER code's weights of one micro-batch, re-implemented from its formula in float64: Omega = |A / pi_old *
    pi (1 - pi)(log pi + H)|, its extremes over the micro-batch's response tokens."""
    pi, pi_old = logps.double().exp(), old_logps.double().exp()
    omega = (advantages.double() / pi_old * pi * (1 - pi) * (torch.log(pi) + entropies.double())).abs()
    valid = omega[mask]
    if mapping == "exp":
        k = -math.log(w_min) / max(float(valid.max()), floor)
        return (-k * omega).exp().clamp(w_min, 1.0)
    low, high = float(valid.min()), float(valid.max())
    return (w_max - (omega - low) * (w_max - w_min) / (high - low)).clamp(w_min, w_max)


def shifted(gen, b, t):
    return torch.randn(b, t, generator=gen, dtype=torch.float64).float() * 0.3  # ratios e^(+-0.3 sigma)


@pytest.mark.numerics
@pytest.mark.parametrize("mapping", ["exp", "linear"])
@pytest.mark.parametrize("ratio_one", [True, False], ids=["ratio-1", "ratio-not-1"])
def test_steer_published_omega_per_micro_batch_is_the_steer_codes(mapping, ratio_one):
    """The weights each loss forward gets with steer_omega='published', steer_scope='micro_batch' are the STEER code's
    for that micro-batch, at ratio 1 (TRL tracks no old log-probs: pi_old = pi) and at ratios e^(+-0.3)."""
    batch = random_batch(seed=4, b=4, t=40, old_shift=None if ratio_one else shifted)
    method = STEER(steer_omega="published", steer_scope="micro_batch", steer_mapping=mapping)
    assert method.rollout_weights(batch).weights is None  # made in the loss forward
    old = batch.logps if ratio_one else batch.old_logps
    for part, old_part in zip(split_rows(batch, 2), (old[:2], old[2:]), strict=True):
        weights = method.micro_batch_terms(part, part.logps).weights
        expected = authors_weights(part.logps, old_part, part.entropies, part.advantages, part.in_loss, mapping)
        # float32 weights of float64 values (6e-8), and Omega_max found among float32 values (6e-8 on k): 1e-6.
        torch.testing.assert_close(weights.double()[part.in_loss], expected[part.in_loss], rtol=1e-6, atol=0)
        assert weights[part.in_loss].min() == pytest.approx(0.8, rel=1e-6)  # the micro-batch's own largest Omega
        if not ratio_one:  # the ratio is in Omega: the weights at ratio 1 differ
            at_one = authors_weights(part.logps, part.logps, part.entropies, part.advantages, part.in_loss, mapping)
            assert (weights.double() - at_one)[part.in_loss].abs().max() > 1e-2


@pytest.mark.numerics
def test_steer_published_omega_over_the_rollout_batch_takes_the_union_extremes():
    """steer_omega='published' with the default scope: the STEER code's Omega, the extremes over every rank's rollout
    batch (the whole batch at once, split over two ranks: the same weights)."""
    batch = random_batch(seed=5, b=6, t=30, old_shift=shifted)
    method = STEER(steer_omega="published")
    weights = method.rollout_weights(batch).weights
    expected = authors_weights(batch.logps, batch.old_logps, batch.entropies, batch.advantages, batch.in_loss, "exp")
    torch.testing.assert_close(weights.double()[batch.in_loss], expected[batch.in_loss], rtol=1e-6, atol=0)
    per_rank = run_ranks(
        lambda part, context: STEER(steer_omega="published").rollout_weights(part, context).weights,
        split_rows(batch, 3),
    )
    torch.testing.assert_close(torch.cat(per_rank), weights, rtol=0, atol=0)
    assert method.micro_batch_terms(batch, batch.logps).weights is None  # nothing more in the loss forward


def test_steer_micro_batch_scope_logs_the_steps_down_weighting_over_ranks():
    """steer_scope='micro_batch': each rank weighs its micro-batches alone; the step's metrics are summed over the
    ranks' micro-batches at the optimizer step."""
    batch = random_batch(seed=6, b=8, t=30)

    def rank(part, context):
        method = STEER(steer_scope="micro_batch")
        weights = [method.micro_batch_terms(mb, mb.logps, context).weights for mb in split_rows(part, 2)]
        method.on_optimizer_step(context)
        return torch.cat(weights), method.pop_metrics()

    results = run_ranks(rank, split_rows(batch, 4))
    weights = torch.cat([w for w, _ in results])
    alone = [STEER(steer_scope="micro_batch").micro_batch_terms(mb, mb.logps).weights for mb in split_rows(batch, 2)]
    torch.testing.assert_close(weights[:2], alone[0], rtol=0, atol=0)  # rank 0's first micro-batch: its own extremes
    in_loss = batch.in_loss
    metrics = results[0][1]
    assert results[1][1] == metrics  # every rank logs the same
    assert metrics["steer/weight_mean"] == pytest.approx(float(weights.double()[in_loss].mean()), rel=1e-9)
    assert metrics["steer/floor_frac"] == pytest.approx(float((weights[in_loss] <= 0.8).double().mean()), rel=1e-9)
    # Four micro-batches, each with a token at the floor: the mean of their largest |d_t|.
    largest = [float(mb.flow.abs()[mb.in_loss].max()) for part in split_rows(batch, 4) for mb in split_rows(part, 2)]
    assert metrics["steer/omega_max"] == pytest.approx(sum(largest) / 4, rel=1e-6)


def test_steer_needs_the_flow():
    batch = flow_batch([[0.1, 0.2]])
    batch.flow = None
    with pytest.raises(ValueError, match="STEER needs the batch's entropy flow"):
        STEER().rollout_weights(batch)


@pytest.mark.parametrize(
    "settings, says",
    [
        (dict(steer_mapping="cubic"), "Unknown steer_mapping 'cubic'"),
        (dict(steer_weight_min=0.0), r"steer_weight_min must lie in \(0, 1\]"),
        (dict(steer_weight_min=0.9, steer_weight_max=0.8), "steer_weight_max must be >= steer_weight_min=0.9"),
        (dict(steer_omega_floor=0.0), "steer_omega_floor must be > 0"),
        (dict(steer_omega="flow"), "Unknown steer_omega 'flow'"),
        (dict(steer_scope="rank"), "Unknown steer_scope 'rank'"),
    ],
)
def test_steer_settings_are_checked(settings, says):
    with pytest.raises(ValueError, match=says):
        STEER(**settings)


@pytest.mark.parametrize("estimate", ["opefo", "param"])
def test_steer_trains_with_opefo_trainer_and_trl_receives_the_weighted_advantages(
    estimate, tiny_model_path, tiny_dataset, length_reward, tmp_path
):
    """Two steps: the advantages TRL's loss reads are the rollout's times STEER's weights of that rollout, with the
    flow of the tabular estimate (weights computed in the training forward) and of `param` (its own pass)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))
    from trainer_setup import logged, make_config, make_trainer, spy

    args = make_config(tmp_path, method="steer", entropy_flow_estimate=estimate)
    trainer = make_trainer(tiny_model_path, tiny_dataset, length_reward, args)
    weighed, applied = [], []

    def record_weights(rollout_weights, batch, context):
        decided = rollout_weights(batch, context)
        weighed.append((batch, decided.weights))
        return decided

    def record_loss(finish, call, loss):
        applied.append(call.inputs["advantages"].clone())
        return finish(call, loss)

    spy(trainer.token_method, "rollout_weights", record_weights)
    spy(trainer.micro_batches, "finish", record_loss)
    trainer.train()
    assert len(weighed) == len(applied) == 2 and len(logged(trainer, "steer/weight_mean")) == 2
    for (batch, weights), advantages in zip(weighed, applied, strict=True):
        assert batch.flow is not None and weights[batch.in_loss].min() < 1
        expected = STEER().rollout_weights(batch).weights  # the same rollout, weighed again on its own
        torch.testing.assert_close(weights, expected, rtol=0, atol=0)
        torch.testing.assert_close(advantages, batch.advantages * weights, rtol=1e-6, atol=0)


def test_steer_as_published_reweighs_every_loss_forward_with_its_ratio(
    tiny_model_path, tiny_dataset, length_reward, tmp_path
):
    """steer_omega='published', steer_scope='micro_batch' with two updates per rollout batch (num_iterations=2, the
    STEER code's several optimizer steps per rollout): each loss forward's advantages are the rollout's times the
    STEER code's weights from that forward's pi, H and TRL's old log-probs; in the second update the ratio is not 1."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))
    from trainer_setup import logged, make_config, make_trainer, spy

    args = make_config(tmp_path, method="steer", steer_omega="published", steer_scope="micro_batch", num_iterations=2)
    trainer = make_trainer(tiny_model_path, tiny_dataset, length_reward, args)
    weighed, applied = [], []

    def record_terms(micro_batch_terms, batch, logps, context):
        terms = micro_batch_terms(batch, logps, context)
        weighed.append((batch, terms.weights))
        return terms

    def record_loss(finish, call, loss):
        applied.append(call.inputs["advantages"].clone())
        return finish(call, loss)

    spy(trainer.token_method, "micro_batch_terms", record_terms)
    spy(trainer.micro_batches, "finish", record_loss)
    trainer.train()
    assert len(weighed) == len(applied) == 2 and len(logged(trainer, "steer/weight_mean")) == 2
    ratios = []
    for (batch, weights), advantages in zip(weighed, applied, strict=True):
        assert batch.old_logps is not None  # TRL tracks them with num_iterations > 1
        mask = batch.in_loss
        expected = authors_weights(batch.logps, batch.old_logps, batch.entropies, batch.advantages, mask, "exp")
        torch.testing.assert_close(weights.double()[mask], expected[mask], rtol=1e-6, atol=0)
        torch.testing.assert_close(advantages, batch.advantages * weights, rtol=1e-6, atol=0)
        ratios.append(float((batch.logps - batch.old_logps)[mask].abs().max()))
    assert ratios[0] < 1e-5 < ratios[1]  # the first update at the rollout's parameters, the second after a step
