"""opefo_trl.experimental.task_tokens: the task's token ids, checked against the model's vocabulary when the trainer
is built (their form is checked with the config: tests/trainer/test_config.py)."""

import sys
from pathlib import Path

import pytest
import torch

from opefo_trl.experimental.task_tokens import task_token_ids

sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))  # trainer_setup: the trainer tests' helpers
from trainer_setup import make_config, make_trainer  # noqa: E402


def test_task_tokens_outside_the_vocabulary_are_refused(tiny_model_path, tiny_dataset, length_reward, tmp_path):
    args = make_config(tmp_path, entropy_flow_task_tokens=[18, 100_000])
    with pytest.raises(ValueError, match=r"entropy_flow_task_tokens \[100000\] are not token ids of this model"):
        make_trainer(tiny_model_path, tiny_dataset, length_reward, args)


def test_task_token_ids_are_the_configs_as_a_long_tensor_and_none_when_unset(tmp_path):
    args = make_config(tmp_path, entropy_flow_task_tokens=[18, 27])
    ids = task_token_ids(args, vocab_size=28, device=torch.device("cpu"))
    assert ids.dtype == torch.long and ids.tolist() == [18, 27]
    assert task_token_ids(make_config(tmp_path), vocab_size=28, device=torch.device("cpu")) is None
    with pytest.raises(ValueError, match=r"\[27\] are not token ids of this model \(vocabulary of 27\)"):
        task_token_ids(args, vocab_size=27, device=torch.device("cpu"))
