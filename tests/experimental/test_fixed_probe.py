"""opefo_trl.experimental.fixed_probe: a fixed probe of prompts never trained on, sampled once by TRL's generation path,
measured by the `param` flow with the batch; refused before loading where it would have no effect."""

import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from opefo_trl import OPEFOTrainer
from opefo_trl.experimental.extension_parts import fixed_probe

sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))  # trainer_setup: the trainer tests' helpers
from trainer_setup import logged, make_config, make_trainer, spy  # noqa: E402

pytestmark = pytest.mark.numerics

STEP_BALANCE = dict(
    entropy_flow_estimate="param", opefo_balance="step", gradient_accumulation_steps=2, per_device_train_batch_size=4
)


def _probe_prompts(count=3):
    return Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"What is {100 + i} + {7 * i}?"}]} for i in range(count)]
    )


def test_the_fixed_probe_is_sampled_once_and_is_what_the_step_balance_holds(
    warm_model_path, tiny_dataset, length_reward, tmp_path
):
    """3 prompts x num_generations 4 = 12 completions, sampled once (TRL's generation, not the training's random
    stream), in micro-batches of 4; every estimate measures them with the batch, and the audit re-scores them after
    each real AdamW step: what it measures is second order, far below GRPO's first-order change of the same tokens."""
    args = make_config(
        tmp_path, max_steps=3, learning_rate=1e-5, optim="adamw_torch", max_grad_norm=1e9, entropy_flow_audit_steps=1,
        **STEP_BALANCE,
    )  # fmt: skip
    trainer = make_trainer(warm_model_path, tiny_dataset, length_reward, args, probe_dataset=_probe_prompts())
    probes, generated = [], []
    fixed_probe = trainer.param_estimate.fixed_probe.__self__
    spy(fixed_probe, "generate", lambda generate, ids, *rest: generated.append(len(ids)) or generate(ids, *rest))

    def record(estimate, items):
        result = estimate(items)
        probes.append(trainer.param_estimate.probe)
        return result

    spy(trainer.param_estimate, "estimate", record)
    trainer.train()
    assert generated == [12]  # sampled once, through TRL's _generate_single_turn
    assert len(probes) == 3 and all(p is not None and len(p) == 3 for p in probes)
    assert all(a[0] is b[0] for p in probes[1:] for a, b in zip(p, probes[0], strict=True))  # the same completions
    for item, mask in probes[0]:
        batch = item.batch
        assert batch["completion_ids"].shape[0] == 4 and mask.shape == batch["completion_ids"].shape
        lengths = batch["completion_mask"].sum(1)
        assert (lengths > 0).all() and torch.equal(mask, batch["completion_mask"].float())
    measured, unweighted = (
        logged(trainer, "entropy_flow/measured_delta"),
        logged(trainer, "opefo/step_change_unweighted"),
    )
    for step in range(3):
        assert abs(logged(trainer, "opefo/step_change")[step]) <= 1e-6 * abs(unweighted[step])
        assert abs(measured[step]) <= 0.1 * abs(unweighted[step]), (step, measured, unweighted)


def test_sampling_the_probe_leaves_the_training_s_random_stream_as_it_was(
    tiny_model_path, tiny_dataset, length_reward, tmp_path
):
    args = make_config(tmp_path, **STEP_BALANCE)
    trainer = make_trainer(tiny_model_path, tiny_dataset, length_reward, args, probe_dataset=_probe_prompts(2))
    prompts = list(_probe_prompts(2)["prompt"])
    probe = fixed_probe(trainer, trainer.loss_mirror, prompts)
    state = torch.get_rng_state()
    first = probe.batches()
    assert torch.equal(torch.get_rng_state(), state)
    assert probe.batches() is first  # sampled once
    again = fixed_probe(trainer, trainer.loss_mirror, prompts).batches()  # the same seed: the same completions
    assert all(
        torch.equal(a[0].batch["completion_ids"], b[0].batch["completion_ids"])
        for a, b in zip(first, again, strict=True)
    )


@pytest.mark.parametrize(
    "overrides, dataset, says",
    [
        (dict(), _probe_prompts(), r"probe_dataset sets the entropy the 'param' estimate measures.*'opefo'"),
        (
            dict(method="grpo", entropy_flow_estimate="param", entropy_flow_diagnostics=False),
            _probe_prompts(),
            "computes no 'param' flow",
        ),
        (dict(entropy_flow_estimate="param"), Dataset.from_list([{"question": "1 + 1?"}]), "needs a 'prompt' column"),
        (dict(entropy_flow_estimate="param"), _probe_prompts(0), "needs a 'prompt' column|has no rows"),
    ],
)
def test_a_probe_without_effect_is_refused_before_the_model_loads(
    tiny_dataset, length_reward, tmp_path, overrides, dataset, says
):
    with pytest.raises(ValueError, match=says):
        OPEFOTrainer(
            model=str(tmp_path / "no-model-here"), reward_funcs=length_reward, args=make_config(tmp_path, **overrides),
            train_dataset=tiny_dataset, probe_dataset=dataset,
        )  # fmt: skip
