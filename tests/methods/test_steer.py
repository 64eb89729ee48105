"""STEER: weights from the size of each token's entropy flow, exp and linear, the floors, over ranks. The weights are
computed in float64 and returned in float32 (relative rounding 2^-24 = 6e-8): the hand values are met to 1e-6."""

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
