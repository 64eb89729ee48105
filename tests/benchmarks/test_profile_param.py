"""benchmarks/profile_param.py: the `param` estimate's phases on the real model, each found and timed."""

import pytest
from conftest import load_benchmark

pytestmark = pytest.mark.real_model


def test_every_phase_of_a_param_step_is_found_and_they_fit_in_the_run():
    profile = load_benchmark("profile_param")
    seconds = profile.profile_param(steps=1, completion_length=8)
    assert set(seconds) == {"total", *profile.PHASES}
    assert all(seconds[phase] > 0 for phase in profile.PHASES), seconds  # a renamed function would read 0
    param = sum(value for phase, value in seconds.items() if phase.startswith("param:"))
    assert param + seconds["generation"] + seconds["TRL backward"] < seconds["total"]
