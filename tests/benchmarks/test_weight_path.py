"""benchmarks/weight_path.py: one rollout's token weights pass through at most six package modules on their way
from TRL's `_prepare_inputs` to the loss, and the parameter-space maths calls nothing back in the trainer."""

import importlib.util
import os

import pytest

pytestmark = pytest.mark.slow


def _load():
    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "weight_path.py")
    spec = importlib.util.spec_from_file_location("weight_path", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


weight_path = _load()


def test_the_recipes_token_weight_passes_through_eleven_modules():
    """The hook, the rollout pass and loss forward, TRL's loss factor, the flow, the method and its protocol, and the
    vocabulary pass of the `opefo` estimate's bias diagnostic (on by default: the moments S_2, S_3 from the hidden
    states, carried with the scores); the reward check and the audit's bookkeeping run in the window too, off the
    weight's path."""
    trace = weight_path.trace("recipes")
    assert trace["weight_path"] == [
        "maths/entropy_flow.py",
        "maths/lm_head.py",
        "maths/vocab_stats.py",
        "methods/base.py",
        "methods/opefo.py",
        "trainer/batch_state.py",
        "trainer/loss_mirror.py",
        "trainer/parts.py",
        "trainer/scoring.py",
        "trainer/token_weights.py",
        "trainer/trainer.py",
    ]
    assert {"trainer/checks.py", "experimental/entropy_audit.py"} <= set(trace["modules"])  # entered, off the path
    assert trace["maths_callbacks"] == {}


def test_the_param_estimates_maths_calls_nothing_back_in_the_trainer():
    """With `param` and the step balance, the maths takes tensors from the trainer and calls back only the root
    finder's function (experimental/opefo_step.py's F(lambda) - target)."""
    trace = weight_path.trace("param")
    assert {"experimental/param_flow.py", "experimental/step_model.py", "experimental/param_estimate.py"} <= set(
        trace["modules"]
    )
    callees = {call.split(" -> ")[1].split(":")[0] for call in trace["maths_callbacks"]}
    assert callees == {"experimental/opefo_step.py"}, trace["maths_callbacks"]
