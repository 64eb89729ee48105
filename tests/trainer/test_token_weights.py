"""opefo_trl.trainer.token_weights: what the rollout pass reads from TRL's rollout and hands to the loss forward."""

import pytest
import torch
from trainer_setup import first_rollout, make_config, make_trainer, spy

from opefo_trl.testing import vllm_generation_emulated
from opefo_trl.trainer.batch_state import STATE_KEY
from opefo_trl.trainer.token_weights import CARRIED_KEYS, carried_scores

#: H_t of TRL's pass over the rollout (8 rows) against TRL's scoring function over one micro-batch (4 rows): the same
#: float32 forward on other batch shapes, whose kernels may sum in another order. H ~ 6 on the tiny model (float32
#: ulp ~5e-7) after ~10 rounded reductions moves by a few 1e-6 at most; 1e-5 leaves a margin. Measured: 0 here and
#: under ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE OMP_NUM_THREADS=1; rows in reverse order are off by 5e-3-7e-3.
ENTROPY_TOLERANCE = 1e-5


@pytest.mark.numerics
def test_trls_old_log_prob_pass_rides_along_its_shuffle_and_split(
    tiny_model_path, tiny_dataset, length_reward, tmp_path
):
    """With vLLM's importance-sampling correction TRL scores the rollout itself: each micro-batch TRL trains on (after
    its shuffle and split) carries that pass's log pi_t, row for row its own `old_per_token_logps`, and H_t, a scoring
    pass's to float32 rounding; the rollout pass takes them out of TRL's dicts and weighs every micro-batch once."""
    args = make_config(tmp_path, gradient_accumulation_steps=2, per_device_train_batch_size=4)
    trainer = make_trainer(tiny_model_path, tiny_dataset, length_reward, args)
    seen = []
    spy(trainer.rollout, "weigh", lambda weigh, batches: seen.append([dict(b) for b in batches]) or weigh(batches))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    with vllm_generation_emulated(trainer), torch.no_grad():
        first_rollout(trainer)
    (batches,) = seen
    assert len(batches) == 2
    for batch in batches:
        carried = carried_scores(batch)
        assert carried is not None and carried.sum_sq_probs is None  # (the `full` sums only with `full`)
        assert torch.equal(carried.logps, batch["old_per_token_logps"])
        mask = batch["completion_mask"].bool()
        scored = trainer.scorer.score(batch)
        torch.testing.assert_close(carried.entropies[mask], scored.entropies[mask], rtol=0, atol=ENTROPY_TOLERANCE)
    for batch in trainer._buffered_inputs:
        assert not set(CARRIED_KEYS) & set(batch)  # taken out: TRL's loss never sees them
        assert batch[STATE_KEY].factor is not None and not batch[STATE_KEY].deferred
