"""opefo_trl.trainer.generation_stats: a rollout of several micro-batches takes log pi_t and H_t from generation's own
logits instead of a scoring pass, and they are the scoring pass's to float32 rounding."""

import pytest
import torch
from trainer_setup import first_rollout, float64_reference, logged, make_config, make_trainer, spy
from transformers import set_seed

from opefo_trl.trainer.token_weights import carried_scores

pytestmark = pytest.mark.numerics

ACCUMULATION = dict(gradient_accumulation_steps=2, per_device_train_batch_size=4)


def _run(tiny_model_path, tiny_dataset, length_reward, tmp_path, from_generation):
    set_seed(0)
    trainer = make_trainer(tiny_model_path, tiny_dataset, length_reward, make_config(tmp_path, **ACCUMULATION))
    assert trainer.rollout.generation is not None
    if not from_generation:
        trainer.rollout.generation = None  # the no-grad scoring pass instead
    rollouts = []

    def record(weigh, batches, **kwargs):
        rollouts.append(([dict(b) for b in batches], carried_scores(batches[0])))
        weigh(batches, **kwargs)

    spy(trainer.rollout, "weigh", record)
    trainer.train()
    return trainer, rollouts


def test_lambda_star_from_generation_is_the_scoring_pass_one(tiny_model_path, tiny_dataset, length_reward, tmp_path):
    """Same seed, two runs of 2 steps: OPEFO's lambda* from generation's statistics against lambda* from the no-grad
    scoring pass; float32 rounding of the two forwards moves it by ~1e-7 (bound 1e-5)."""
    common = (tiny_model_path, tiny_dataset, length_reward, tmp_path)
    ours, rollouts = _run(*common, from_generation=True)
    assert len(rollouts) == 2 and all(captured is not None for _, captured in rollouts)  # no scoring pass of ours
    reference, reference_rollouts = _run(*common, from_generation=False)
    assert all(captured is None for _, captured in reference_rollouts)
    lam, lam_reference = logged(ours, "entropy_flow/lambda"), logged(reference, "entropy_flow/lambda")
    assert lam == pytest.approx(lam_reference, abs=1e-5), (lam, lam_reference)
    assert min(abs(x) for x in lam) > 1e-3


def test_the_statistics_read_from_generation_are_the_scoring_passs(
    tiny_model_path, tiny_dataset, length_reward, tmp_path
):
    """Token by token, on the micro-batches TRL trains on (carried through TRL's shuffle and split): the KV-cached
    generation and the teacher-forced scoring pass differ by float32 rounding (~1e-6 on |log pi| <= 10)."""
    trainer = make_trainer(tiny_model_path, tiny_dataset, length_reward, make_config(tmp_path, **ACCUMULATION))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    captured = []
    spy(trainer.rollout, "weigh", lambda weigh, batches, **_: captured.append([dict(b) for b in batches]))
    first_rollout(trainer)
    (batches,) = captured
    for batch in batches:
        rows = carried_scores(batch)
        assert rows is not None
        scored = trainer.scorer.score(batch)
        mask = batch["completion_mask"].bool()
        torch.testing.assert_close(rows.logps[mask], scored.logps[mask], rtol=0, atol=1e-5)
        torch.testing.assert_close(rows.entropies[mask], scored.entropies[mask], rtol=0, atol=1e-5)


def test_the_full_estimates_vocabulary_sums_read_from_generation_are_the_scoring_passs(
    tiny_model_path, tiny_dataset, length_reward, tmp_path
):
    """The surprise-gap moments S_2, S_3 from generation's logits against the scoring pass's vocabulary pass, token
    by token (float32 rounding of two forwards)."""
    args = make_config(tmp_path, entropy_flow_estimate="full", **ACCUMULATION)
    trainer = make_trainer(tiny_model_path, tiny_dataset, length_reward, args)
    assert trainer.rollout.generation is not None and trainer.rollout.generation.vocab
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    captured = []
    spy(trainer.rollout, "weigh", lambda weigh, batches, **_: captured.append([dict(b) for b in batches]))
    first_rollout(trainer)
    (batches,) = captured
    for batch in batches:
        rows = carried_scores(batch)
        assert rows is not None
        scored = trainer.scorer.score(batch, vocab=True)
        mask = batch["completion_mask"].bool()
        for ours, theirs in zip(rows.moments, scored.moments, strict=True):
            torch.testing.assert_close(ours[mask], theirs[mask], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("estimate", ["opefo", "full"])
@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_generation_statistics_at_a_temperature_are_the_float64_softmax_of_the_scaled_logits(
    tiny_model_path, tiny_dataset, length_reward, tmp_path, temperature, estimate
):
    """At the training temperature T != 1 (sampling and scoring both divide the logits by T), log pi_t, H_t and the
    surprise-gap moments read from generation against an independent float64 scoring (a plain float64 copy of the
    model, full softmax of logits / T). The float32 forward rounds the logits by ~1e-6 relative (|z| <~ 10 on the
    tiny model), which moves log pi and H by ~1e-5 at most; the bound is 1e-4. Logits not divided by T are off by
    ~0.1-1."""
    args = make_config(tmp_path, temperature=temperature, entropy_flow_estimate=estimate, **ACCUMULATION)
    trainer = make_trainer(tiny_model_path, tiny_dataset, length_reward, args)
    assert trainer.rollout.generation is not None
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    captured = []
    spy(trainer.rollout, "weigh", lambda weigh, batches, **_: captured.append([dict(b) for b in batches]))
    first_rollout(trainer)
    (batches,) = captured
    for batch in batches:
        rows = carried_scores(batch)
        assert rows is not None
        mask = batch["completion_mask"].bool()
        logps, entropies, moment2, moment3 = float64_reference(tiny_model_path, batch, temperature)
        ours = [rows.logps, rows.entropies, *(rows.moments if estimate == "full" else ())]
        for value, reference in zip(ours, (logps, entropies, moment2, moment3), strict=False):
            torch.testing.assert_close(value[mask].double(), reference[mask], rtol=0, atol=1e-4)
