"""opefo_trl.data.reward_modes: the math_reward_mode option, declared once and taken by opefo-train and opefo-eval."""

import dataclasses

import pytest

from opefo_trl.cli.train_arguments import TrainScriptArguments
from opefo_trl.data.reward_modes import MATH_REWARD_MODE_HELP, MATH_REWARD_MODES, check_math_reward_mode
from opefo_trl.eval import EvaluationConfig


def test_the_modes_and_a_mode_that_does_not_exist():
    assert MATH_REWARD_MODES == ("equivalent", "strict")
    for mode in MATH_REWARD_MODES:
        check_math_reward_mode(mode)
    with pytest.raises(ValueError, match=r"math_reward_mode='Strict' is not a mode of the math reward; give"):
        check_math_reward_mode("Strict")


@pytest.mark.parametrize("options", [TrainScriptArguments, EvaluationConfig])
def test_both_commands_take_the_one_declaration(options):
    """opefo-train defaults to 'equivalent'; opefo-eval to the run's own mode (None until read), else 'equivalent'."""
    (mode,) = [f for f in dataclasses.fields(options) if f.name == "math_reward_mode"]
    assert mode.metadata["help"].startswith(MATH_REWARD_MODE_HELP)
    if options is TrainScriptArguments:
        assert mode.default == "equivalent" and mode.metadata["help"] == MATH_REWARD_MODE_HELP
    else:
        assert mode.default is None and mode.metadata["help"].endswith("'equivalent'.")
