"""opefo_trl.trainer.token_weights: what the rollout pass reads from TRL's rollout and hands to the loss forward."""

import pytest
import torch
from trainer_setup import first_rollout, make_config, make_trainer, spy
from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict

from opefo_trl.testing import vllm_generation_emulated
from opefo_trl.trainer.batch_state import STATE_KEY
from opefo_trl.trainer.loss_mirror import LOSS_TYPES
from opefo_trl.trainer.token_weights import CARRIED_KEYS, carried_scores, micro_batch_state

#: H_t of TRL's pass over the rollout (8 rows) against TRL's scoring function over one micro-batch (4 rows): the same
#: float32 forward on other batch shapes, whose kernels may sum in another order. H ~ 6 on the tiny model (float32
#: ulp ~5e-7) after ~10 rounded reductions moves by a few 1e-6 at most; 1e-5 leaves a margin. Measured: 0 here and
#: under ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE OMP_NUM_THREADS=1; rows in reverse order are off by 5e-3-7e-3.
ENTROPY_TOLERANCE = 1e-5


@pytest.mark.numerics
def test_trls_old_log_prob_pass_is_read_and_the_weights_ride_along_its_shuffle_and_split(
    tiny_model_path, tiny_dataset, length_reward, tmp_path
):
    """With vLLM's importance-sampling correction TRL scores the rollout itself: the rollout TRL returns carries that
    pass's log pi_t, row for row its own `old_per_token_logps`, and H_t, a scoring pass's to float32 rounding. The
    rollout is weighed there, once, before TRL's shuffle and split (dapo's f_t does not depend on the split): every
    micro-batch TRL trains on holds (B, T) weighted advantages and its state, row for row with its tokens."""
    args = make_config(tmp_path, gradient_accumulation_steps=2, per_device_train_batch_size=4)
    trainer = make_trainer(tiny_model_path, tiny_dataset, length_reward, args)
    assert trainer.rollout.weighs_before_split
    seen = []

    def record(weigh, batches, **kwargs):
        seen.append(([dict(b) for b in batches], kwargs))
        weigh(batches, **kwargs)

    spy(trainer.rollout, "weigh", record)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    with vllm_generation_emulated(trainer), torch.no_grad():
        first_rollout(trainer)
    ((rollout,), kwargs) = seen[0]
    assert len(seen) == 1 and kwargs == {"split_into": 2} and len(rollout["completion_ids"]) == 8
    carried = carried_scores(rollout)
    assert carried is not None and carried.moment2 is not None  # (the default estimate's bias diagnostic needs them)
    assert torch.equal(carried.logps, rollout["old_per_token_logps"])
    mask = rollout["completion_mask"].bool()
    scored = trainer.scorer.score(rollout)
    torch.testing.assert_close(carried.entropies[mask], scored.entropies[mask], rtol=0, atol=ENTROPY_TOLERANCE)
    row_of = {
        tuple(ids.tolist()): i for i, ids in enumerate(torch.cat([rollout["prompt_ids"], rollout["completion_ids"]], 1))
    }
    assert len(row_of) == 8  # rows are told apart by their tokens
    for batch in trainer._buffered_inputs:
        assert not set(CARRIED_KEYS) & set(batch)  # taken out: TRL's loss never sees them
        state = micro_batch_state(batch)
        assert state is not None and not state.deferred and STATE_KEY not in batch
        assert batch["advantages"].shape == batch["completion_mask"].shape  # per-token advantages, set before the split
        rows = [row_of[tuple(ids.tolist())] for ids in torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)]
        torch.testing.assert_close(state.advantages, rollout["advantages"][rows, None].expand_as(state.advantages))
        assert torch.equal(batch["old_per_token_logps"], rollout["old_per_token_logps"][rows])


def _tensors_copied(batch: dict) -> dict:
    return {key: value.clone() if torch.is_tensor(value) else value for key, value in batch.items()}


def _shuffled_and_split(batch: dict, micro_batches: int) -> list[dict]:
    """TRL's shuffle and split (`GRPOTrainer._prepare_inputs`), under a fixed permutation."""
    torch.manual_seed(1)
    return split_tensor_dict(shuffle_sequence_dict(batch), micro_batches)


@pytest.mark.numerics
@pytest.mark.parametrize("accumulation", [1, 2, 4])
@pytest.mark.parametrize("loss_type", [t for t in LOSS_TYPES if t != "bnpo"])
def test_weights_set_before_trls_split_are_those_set_after_it(
    tiny_model_path, tiny_dataset, length_reward, tmp_path, loss_type, accumulation
):
    """One rollout (TRL's pass under vLLM's importance-sampling correction), weighed whole before TRL's shuffle and
    split, and weighed as TRL's micro-batches after it (the trainer's path for `bnpo` and the `param` estimate): the
    same lambda* (fp64 sums in another order: 1e-12), and on every micro-batch the same weighted advantages, f_t, u_t,
    TRL's loss and its gradient, bit for bit (the same float32 operations on the same values; a factor computed with
    the rollout's row count instead of the micro-batch's is off by the accumulation factor)."""
    args = make_config(
        tmp_path, loss_type=loss_type, gradient_accumulation_steps=accumulation, per_device_train_batch_size=4
    )
    trainer = make_trainer(tiny_model_path, tiny_dataset, length_reward, args)
    weigh, rollouts = trainer.rollout.weigh, []
    spy(trainer.rollout, "weigh", lambda _, batches, **__: rollouts.append(_tensors_copied(batches[0])))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = accumulation
    with vllm_generation_emulated(trainer):
        assert trainer.rollout.weighs_before_split
        with torch.no_grad():
            first_rollout(trainer)  # generated and scored; the spy keeps it unweighed
        (rollout,) = rollouts
        whole = _tensors_copied(rollout)
        weigh([whole], split_into=accumulation)
        lambda_before = trainer.token_method.lambda_star
        before = _shuffled_and_split(whole, accumulation)
        after = _shuffled_and_split(_tensors_copied(rollout), accumulation)
        weigh(after)
        lambda_after = trainer.token_method.lambda_star
        assert lambda_before == pytest.approx(lambda_after, abs=1e-12) and lambda_before != 0.0
        for ours, theirs in zip(before, after, strict=True):
            state, reference = micro_batch_state(ours), theirs[STATE_KEY]
            assert ours["advantages"].dim() == 2 and torch.equal(ours["advantages"], theirs["advantages"])
            for name in ("advantages", "factor", "unit_flow"):
                assert torch.equal(getattr(state, name), getattr(reference, name)), name
        gradients = []
        for micro_batch in (before[0], after[0]):
            trainer.model.zero_grad()
            loss = trainer.compute_loss(trainer.model, micro_batch)
            loss.backward()
            gradients.append(
                (loss.detach(), [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None])
            )
    (loss_before, grads_before), (loss_after, grads_after) = gradients
    assert torch.equal(loss_before, loss_after) and len(grads_before) == len(grads_after) > 0
    assert all(torch.equal(a, b) for a, b in zip(grads_before, grads_after, strict=True))


@pytest.mark.parametrize("options", [dict(loss_type="bnpo"), dict(top_entropy_quantile=0.5)])
def test_a_factor_that_depends_on_trls_split_is_weighed_after_it(
    tiny_model_path, tiny_dataset, length_reward, tmp_path, options
):
    """bnpo normalises by the micro-batch's token count and the high-entropy mask takes a quantile per micro-batch:
    their rollouts are weighed at the first loss, over TRL's micro-batches, and the factor refuses a whole rollout."""
    args = make_config(tmp_path, gradient_accumulation_steps=2, per_device_train_batch_size=4, **options)
    trainer = make_trainer(tiny_model_path, tiny_dataset, length_reward, args)
    assert not trainer.rollout.weighs_before_split
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    inputs = first_rollout(trainer)
    assert all(STATE_KEY in batch for batch in trainer._buffered_inputs) and inputs[STATE_KEY].factor is not None
    with pytest.raises(ValueError, match="depends on TRL's split"):
        trainer.loss_mirror.factor(
            inputs, inputs["completion_mask"].float(), inputs["completion_mask"].float(), inputs["advantages"], rows=4
        )


@pytest.mark.numerics
@pytest.mark.parametrize("estimate", ["opefo", "opefo_centered"])
def test_the_logged_bias_part_of_lambda_star_is_that_of_a_float64_model(
    warm_model_path, tiny_dataset, length_reward, tmp_path, estimate
):
    """entropy_flow/lambda and entropy_flow/lambda_bias of the first step against an independent float64 copy of the
    model (full softmax): lambda_bias = -sum A E_pi[u] / (P + N), E_pi[u] = 2 S_2 - S_3 for `opefo`, 0 exactly for
    `opefo_centered` (dapo's f_t is the same for every token and cancels), on the warm model's peaked policies. The
    float32 forward moves log pi, H and the
    moments by ~1e-5 at most (test_generation_stats), which moves these ratios by ~1e-4; the bound is 1e-3, against
    |lambda_bias| ~0.1-1 here."""
    from trainer_setup import float64_reference, logged

    args = make_config(tmp_path, max_steps=1, loss_type="dapo", entropy_flow_estimate=estimate)
    trainer = make_trainer(warm_model_path, tiny_dataset, length_reward, args)
    captured = []
    spy(
        trainer.rollout, "weigh", lambda weigh, batches, **kw: captured.append(dict(batches[0])) or weigh(batches, **kw)
    )
    trainer.train()
    (batch,) = captured
    logps, entropies, moment2, moment3 = float64_reference(warm_model_path, batch, temperature=1.0)
    mask = batch["completion_mask"].double()
    advantages = batch["advantages"].double()[:, None]
    mean = 2 * moment2 - moment3
    unit = -((1 - logps.exp()) ** 2) * (logps + entropies)
    if estimate == "opefo_centered":
        unit = unit - mean
        mean = torch.zeros_like(mean)
    flow = advantages * unit * mask
    increase, decrease = flow.clamp(min=0).sum(), -flow.clamp(max=0).sum()
    if estimate == "opefo_centered":  # its on-policy mean is 0 exactly: no bias part is logged
        assert not logged(trainer, "entropy_flow/lambda_bias")
        lam = float((decrease - increase) / (increase + decrease))
        assert logged(trainer, "entropy_flow/lambda")[0] == pytest.approx(lam, abs=1e-3)
        return
    lambda_bias = logged(trainer, "entropy_flow/lambda_bias")[0]
    assert logged(trainer, "entropy_flow/lambda")[0] == pytest.approx(
        float((decrease - increase) / (increase + decrease)), abs=1e-3
    )
    assert lambda_bias == pytest.approx(float(-(advantages * mean * mask).sum() / (increase + decrease)), abs=1e-3)
    assert logged(trainer, "entropy_flow/lambda_net_of_bias")[0] == pytest.approx(
        logged(trainer, "entropy_flow/lambda")[0] - lambda_bias, abs=1e-12
    )
    assert abs(lambda_bias) > 1e-2  # the check has something to see
