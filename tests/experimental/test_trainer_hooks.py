"""opefo_trl.experimental.trainer_hooks: the extensions' hooks are a mixin of OPEFOTrainer's, inert with the paper's
options (the `param` estimate's optimizer check: tests/trainer/test_trainer.py, a custom optimizer refused)."""

import sys
from pathlib import Path

from opefo_trl import OPEFOTrainer
from opefo_trl.experimental.trainer_hooks import ExtensionHooks

sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))  # trainer_setup: the trainer tests' helpers
from trainer_setup import logged, make_config, make_trainer  # noqa: E402


def test_the_hooks_come_before_trls_trainer_in_opefo_trainers_bases():
    mro = OPEFOTrainer.__mro__
    assert mro.index(ExtensionHooks) < mro.index(next(c for c in mro if c.__name__ == "GRPOTrainer"))
    assert "create_optimizer" not in vars(OPEFOTrainer)  # the extensions' override, not the trainer's own


def test_with_the_papers_options_the_audit_measures_nothing(tiny_model_path, tiny_dataset, length_reward, tmp_path):
    trainer = make_trainer(tiny_model_path, tiny_dataset, length_reward, make_config(tmp_path, max_steps=1))
    trainer.train()
    assert trainer.param_estimate is None and trainer.audit.every == 0
    assert logged(trainer, "entropy_flow/measured_delta") == []
