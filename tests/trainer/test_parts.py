"""opefo_trl.trainer.parts: which parts a configuration gets, and what is checked against the model when they are
built."""

import pytest
from trainer_setup import make_config, make_trainer


@pytest.mark.parametrize(
    "settings, rollout, param",
    [
        (dict(method="grpo"), False, False),  # diagnostics from the loss forward only
        (dict(method="opefo"), True, False),
        (dict(method="opefo", entropy_flow_estimate="param"), True, True),
    ],
)
def test_a_configuration_gets_the_parts_it_needs(
    tiny_model_path, tiny_dataset, length_reward, tmp_path, settings, rollout, param
):
    trainer = make_trainer(tiny_model_path, tiny_dataset, length_reward, make_config(tmp_path, **settings))
    assert (trainer.rollout is not None) == rollout and (trainer.param_estimate is not None) == param
    assert trainer.audit in trainer.callback_handler.callbacks


def test_task_tokens_outside_the_vocabulary_are_refused(tiny_model_path, tiny_dataset, length_reward, tmp_path):
    args = make_config(tmp_path, entropy_flow_task_tokens=[18, 100_000])
    with pytest.raises(ValueError, match=r"entropy_flow_task_tokens \[100000\] are not token ids of this model"):
        make_trainer(tiny_model_path, tiny_dataset, length_reward, args)
