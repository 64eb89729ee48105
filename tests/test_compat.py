"""The TRL check: the tested range imports silently, a newer TRL with the hooks the trainer expects imports with one
warning naming the tested range, a newer one whose hook changed (or an older one) is refused naming it."""

import warnings

import pytest
import trl
from trl import GRPOTrainer

from opefo_trl._compat import TRL_HOOKS, TRL_TESTED, check_installed_trl, check_trl_version, hook_change


@pytest.mark.parametrize("version", ["1.16.0", "1.16.3", "1.16.1.dev0"])
def test_the_tested_range_imports_silently(version):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_trl_version(version) == version


@pytest.mark.parametrize("version", ["1.15.0", "0.29.1", "1.15.9.post1"])
def test_an_older_trl_is_refused_with_the_floor_and_the_fix(version):
    with pytest.raises(ImportError, match=rf"needs TRL >= 1.16.0 \(tested: {TRL_TESTED}\), but TRL {version} .*pip"):
        check_trl_version(version)


@pytest.mark.parametrize("version", ["1.17.0", "2.0.0"])
def test_a_newer_trl_with_the_expected_hooks_imports_with_one_warning_naming_the_tested_range(version):
    with pytest.warns(UserWarning) as record:
        assert check_trl_version(version, GRPOTrainer) == version
    assert len(record) == 1
    assert str(record[0].message).startswith(f"opefo-trl is tested with TRL {TRL_TESTED}; TRL {version} is installed.")


class _ParameterInserted(GRPOTrainer):
    def _generate_and_score_completions(self, loss_scale, inputs):  # a new parameter before the one OPEFO passes
        raise NotImplementedError


class _RequiredParameterAppended(GRPOTrainer):
    def _save_checkpoint(self, model, trial, step):  # OPEFO's call would no longer bind
        raise NotImplementedError


class _OptionalParameterAppended(GRPOTrainer):
    def _generate_and_score_completions(self, inputs, loss_scale=1.0):  # calls still bind
        raise NotImplementedError


class _HookRemoved(GRPOTrainer):
    _tokenize_prompts = None


def test_a_newer_trl_whose_hook_changed_is_refused_naming_the_hook():
    with pytest.raises(ImportError) as err:
        check_trl_version("1.17.0", _ParameterInserted)
    message = str(err.value)
    assert "tested with TRL >=1.16.0,<1.17.0, and in the installed TRL 1.17.0" in message
    assert "`_generate_and_score_completions` takes (loss_scale, inputs) where OPEFOTrainer expects (inputs" in message
    assert message.endswith("Install a tested TRL: `pip install 'trl>=1.16.0,<1.17.0'`.")
    with pytest.raises(ImportError, match=r"`_save_checkpoint` takes \(model, trial, step\) where"):
        check_trl_version("1.17.0", _RequiredParameterAppended)
    with pytest.raises(ImportError, match="`_tokenize_prompts` no longer exists"):
        check_trl_version("1.17.0", _HookRemoved)
    with pytest.warns(UserWarning, match="have the parameters it expects"):
        check_trl_version("1.17.0", _OptionalParameterAppended)


def test_every_grpo_trainer_method_opefo_trainer_overrides_is_checked():
    from opefo_trl import OPEFOTrainer

    ours = OPEFOTrainer.__mro__[: OPEFOTrainer.__mro__.index(GRPOTrainer)]  # the trainer and its mixins
    overridden = {
        name for cls in ours for name, value in vars(cls).items() if callable(value) and hasattr(GRPOTrainer, name)
    }
    assert overridden <= set(TRL_HOOKS), f"add {sorted(overridden - set(TRL_HOOKS))} to opefo_trl._compat.TRL_HOOKS"
    # The private ones, each listed with what it relies on in CONTRIBUTING.md ("Support a new TRL version").
    assert {name for name in overridden if name.startswith("_") and not name.startswith("__")} == {
        "_generate_and_score_completions",
        "_get_per_token_logps_and_entropies",
        "_save_checkpoint",
    }


def test_the_installed_trl_has_every_hook_as_expected():
    assert check_trl_version() == trl.__version__
    changes = {name: hook_change(GRPOTrainer, name, expected) for name, expected in TRL_HOOKS.items()}
    assert changes == dict.fromkeys(TRL_HOOKS)


def test_the_installed_trl_is_checked_once_per_process(monkeypatch):
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    check_installed_trl.cache_clear()
    try:
        with pytest.warns(UserWarning) as record:
            check_installed_trl()
            check_installed_trl()
    finally:
        check_installed_trl.cache_clear()
    assert len(record) == 1
