"""A method added by one file (tests/methods/example_method.py) trains with OPEFOTrainer, gets its options the way
the built-in methods get theirs, and appears in every list made from the registry."""

import importlib
import sys

import pytest
import torch

from opefo_trl.methods import TOKEN_METHODS, method_choices, methods_table

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "trainer"))  # trainer_setup


@pytest.fixture
def example():
    """The example method's module, imported (which registers it) and unregistered afterwards."""
    module = importlib.import_module("example_method")
    yield module
    TOKEN_METHODS.pop("damp_negative", None)
    sys.modules.pop("example_method", None)


def test_a_method_of_one_file_trains_and_logs(example, tiny_model_path, tiny_dataset, length_reward, tmp_path):
    from trainer_setup import base_settings, logged, make_trainer, spy

    from opefo_trl.trainer.config import OPEFOConfig, config_class

    Config = config_class(example.DampNegative)
    assert issubclass(Config, OPEFOConfig) and config_class(example.DampNegative) is not OPEFOConfig
    args = Config(**base_settings(tmp_path), method="damp_negative", damp_negative_weight=0.25)
    trainer = make_trainer(tiny_model_path, tiny_dataset, length_reward, args)
    seen = []

    def record(apply, call, logps, entropies, vocab):
        original = call.inputs["advantages"].clone()
        apply(call, logps, entropies, vocab)
        seen.append((original, call.inputs["advantages"]))

    spy(trainer.micro_batches, "apply", record)
    trainer.train()
    assert len(logged(trainer, "damp_negative/frac")) == 2 and len(seen) == 2
    for original, applied in seen:
        expected = torch.where(original < 0, 0.25 * original, original)[:, None].expand_as(applied)
        torch.testing.assert_close(applied, expected)
    with pytest.raises(ValueError, match=r"damp_negative_weight must lie in \[0, 1\]"):
        Config(**base_settings(tmp_path), method="damp_negative", damp_negative_weight=2.0)
    with pytest.raises(ValueError, match="is a setting of method='damp_negative' and has no effect with method='par'"):
        Config(**base_settings(tmp_path), method="par", damp_negative_weight=0.3)


def test_a_method_of_one_file_is_in_every_list_and_its_options_parse(example):
    from trl import TrlParser

    from opefo_trl.trainer.config import config_class

    assert "'damp_negative' (negative-advantage tokens damped)" in method_choices()
    assert '| DampNegative | `method="damp_negative"` (`damp_negative_weight=0.5`) |' in methods_table()
    (args,) = TrlParser([config_class(example.DampNegative)]).parse_args_into_dataclasses(
        ["--output_dir", "out", "--method", "damp_negative", "--damp_negative_weight", "0.75", "--use_cpu", "true",
         "--bf16", "false"]
    )  # fmt: skip
    assert args.method == "damp_negative" and args.damp_negative_weight == 0.75
