"""opefo_trl.experimental.extension_parts: the extensions' parts are built from the trainer's own settings."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))  # trainer_setup: the trainer tests' helpers
from trainer_setup import make_config, make_trainer  # noqa: E402


def test_the_param_estimate_and_the_audit_take_the_trainers_settings(
    tiny_model_path, tiny_dataset, length_reward, tmp_path
):
    args = make_config(
        tmp_path,
        entropy_flow_estimate="param",
        entropy_flow_probe_rollouts=3,
        entropy_flow_audit_steps=2,
        max_grad_norm=0.5,
    )
    trainer = make_trainer(tiny_model_path, tiny_dataset, length_reward, args)
    estimate = trainer.param_estimate
    assert (estimate._earlier.maxlen, estimate.max_grad_norm, estimate.num_processes) == (3 - 1, 0.5, 1)
    assert estimate.fixed_probe is None  # no probe prompts given
    assert trainer.audit.every == 2 and trainer.audit in trainer.callback_handler.callbacks
    assert [p.data_ptr() for p in estimate.params()] == [p.data_ptr() for p in trainer.model.parameters()]
