"""STARE: the top-surprisal share of each advantage-sign group, the entropy gate, the weights, over ranks."""

import math

import pytest
import torch
from methods_batch import random_batch, run_ranks, split_rows

from opefo_trl.methods import STARE, TokenBatch

# Row 0 has a positive advantage, row 1 a negative one; surprisal -log pi = 0.1 .. 0.8 and a padding token.
PROBABILITIES = torch.tensor([[0.9, 0.5, 0.2, 0.7, 0.01], [0.3, 0.6, 0.05, 0.8, 0.4]], dtype=torch.float64)


def hand_batch(entropy):
    factor = torch.ones(2, 5, dtype=torch.float64)
    factor[0, 4] = 0  # padding: the most surprising token, outside the loss
    return TokenBatch(
        logps=PROBABILITIES.log(),
        entropies=torch.full((2, 5), entropy, dtype=torch.float64),
        advantages=torch.tensor([[1.5] * 5, [-0.5] * 5], dtype=torch.float64),
        factor=factor,
    )


def test_stare_o1_weights_the_top_surprisal_positive_tokens_while_entropy_is_below_target():
    # Positive group: 4 tokens in the loss, top 0.3 -> ceil(1.2) = 2 of highest -log pi: pi = 0.2 and 0.5.
    method = STARE(stare_top_ratio=0.3, stare_weight_positive=1.25, stare_target_entropy=0.5)
    weights = method.rollout_weights(hand_batch(entropy=0.4)).weights
    expected = torch.tensor([[1.0, 1.25, 1.25, 1.0, 1.0], [1.0] * 5], dtype=torch.float32)
    torch.testing.assert_close(weights, expected, rtol=0, atol=0)
    assert method.pop_metrics() == pytest.approx(
        {"stare/gate_on": 1.0, "stare/entropy": 0.4, "stare/positive_frac": 2 / 9, "stare/negative_frac": 0.0}
    )


def test_stare_c2_also_damps_the_top_surprisal_negative_tokens():
    # Negative group: 5 tokens, top 0.3 -> ceil(1.5) = 2: pi = 0.05 and 0.3.
    method = STARE(stare_variant="C2", stare_top_ratio=0.3, stare_weight_negative=0.7, stare_target_entropy=0.5)
    weights = method.rollout_weights(hand_batch(entropy=0.4)).weights
    expected = torch.tensor([[1.0, 1.1, 1.1, 1.0, 1.0], [0.7, 1.0, 0.7, 1.0, 1.0]], dtype=torch.float32)
    torch.testing.assert_close(weights, expected, rtol=0, atol=0)
    assert method.pop_metrics()["stare/negative_frac"] == pytest.approx(2 / 9)


def test_stare_is_plain_grpo_once_the_entropy_reaches_the_target():
    method = STARE(stare_variant="C2", stare_target_entropy=0.5)
    weights = method.rollout_weights(hand_batch(entropy=0.5)).weights  # not below the target: gate off
    assert torch.equal(weights, torch.ones(2, 5))
    metrics = method.pop_metrics()
    assert metrics["stare/gate_on"] == 0.0 and metrics["stare/positive_frac"] > 0  # still measured


def test_stare_over_two_ranks_selects_the_shares_of_the_union():
    batch = random_batch(seed=7, b=6, t=30)
    batch.entropies = batch.entropies * 0.1  # mean 0.1: gate on
    method = STARE(stare_variant="C2", stare_top_ratio=0.15)
    whole = method.rollout_weights(batch).weights
    assert (whole > 1).any() and (whole < 1).any()
    per_rank = run_ranks(lambda part, context: STARE(stare_variant="C2", stare_top_ratio=0.15).rollout_weights(
        part, context).weights, split_rows(batch, 2))  # fmt: skip
    torch.testing.assert_close(torch.cat(per_rank), whole, rtol=0, atol=0)
    # Each rank alone would select its own shares: different from the union's.
    alone = torch.cat([method.rollout_weights(part).weights for part in split_rows(batch, 2)])
    assert not torch.equal(alone, whole)


def test_stare_selection_counts_are_the_ceiling_of_the_share():
    batch = random_batch(seed=8, b=4, t=50)
    batch.entropies = batch.entropies * 0
    batch.advantages = torch.tensor([2.0, 1.0, -1.0, 0.0])[:, None].expand(4, 50)
    method = STARE(stare_variant="C2", stare_top_ratio=0.07)
    weights = method.rollout_weights(batch).weights
    positive = int(((batch.advantages > 0) & batch.in_loss).sum())
    negative = int(((batch.advantages < 0) & batch.in_loss).sum())
    assert int((weights > 1).sum()) == math.ceil(0.07 * positive)
    assert int((weights < 1).sum()) == math.ceil(0.07 * negative)
    assert torch.all(weights[3] == 1)  # zero advantage: in neither group


@pytest.mark.parametrize(
    "settings, says",
    [
        (dict(stare_variant="both"), "Unknown stare_variant 'both'"),
        (dict(stare_top_ratio=0.0), r"stare_top_ratio must lie in \(0, 1\]"),
        (dict(stare_weight_positive=0.9), "stare_weight_positive is W, which amplifies, so >= 1"),
        (dict(stare_weight_negative=1.2), r"stare_weight_negative is M, which attenuates, in \[0, 1\]"),
        (dict(stare_target_entropy=-1.0), "stare_target_entropy is a mean token entropy"),
    ],
)
def test_stare_settings_are_checked(settings, says):
    with pytest.raises(ValueError, match=says):
        STARE(**settings)


def test_stare_trains_with_opefo_trainer_and_trl_receives_the_weighted_advantages(
    tiny_model_path, tiny_dataset, length_reward, tmp_path
):
    """Two steps with the gate held open (a target above the tiny model's entropy): TRL's loss reads the rollout's
    advantages times weights that put W on exactly the top-surprisal share of the positive-advantage tokens."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))
    from trainer_setup import logged, make_config, make_trainer, spy

    args = make_config(tmp_path, method="stare", stare_target_entropy=100.0, stare_variant="C2", stare_top_ratio=0.2)
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
    assert len(weighed) == len(applied) == 2 and logged(trainer, "stare/gate_on") == [1.0, 1.0]
    for (batch, weights), advantages in zip(weighed, applied, strict=True):
        for sign, weight in ((1, 1.1), (-1, 0.9)):
            group = batch.in_loss & (torch.sign(batch.advantages) == sign)
            surprisal = -batch.logps[group]
            top = surprisal >= surprisal.sort(descending=True).values[math.ceil(0.2 * group.sum()) - 1]
            assert top.any()
            torch.testing.assert_close(weights[group], torch.where(top, weight, 1.0), rtol=0, atol=0)
        torch.testing.assert_close(advantages, batch.advantages * weights, rtol=1e-6, atol=0)
