"""The warm start: cached per task, numerics setting and settings; trained on the training targets only."""

import json
import math

import pytest

from opefo_trl.demo import warm_start
from opefo_trl.demo.warm_start import WARM_START_MARKER

pytestmark = pytest.mark.slow


def test_warm_start_is_cached_per_task_numerics_and_settings(tmp_path, tiny_settings):
    settings = tiny_settings(warm_start_steps=4)
    messages = []
    path = warm_start(str(tmp_path), settings, "threads1", log=messages.append)
    assert path.endswith("warm_start-digit_sum-threads1")
    marker = json.loads((tmp_path / "models" / "warm_start-digit_sum-threads1" / WARM_START_MARKER).read_text())
    assert marker["settings"]["warm_start_steps"] == 4 and math.isfinite(marker["final_loss"])
    assert 101 not in marker["settings"]["targets"] and 100 in marker["settings"]["targets"]
    assert not any("reusing" in m for m in messages)
    messages.clear()
    assert warm_start(str(tmp_path), settings, "threads1", log=messages.append) == path
    assert messages == [f"warm start: reusing {path}"]
    # a different warm-start setting retrains instead of reusing stale weights
    messages.clear()
    warm_start(str(tmp_path), tiny_settings(warm_start_steps=3), "threads1", log=messages.append)
    assert not any("reusing" in m for m in messages)
    # another numerics setting, and another task, have their own warm start
    assert warm_start(str(tmp_path), settings, "threads2", log=messages.append).endswith("digit_sum-threads2")
    other = warm_start(str(tmp_path), tiny_settings(warm_start_steps=4, task="sum"), "threads1", log=messages.append)
    assert other.endswith("warm_start-sum-threads1") and other != path


def test_a_kill_while_the_marker_is_written_leaves_no_cut_marker(tmp_path, tiny_settings):
    """T: a real warm start killed (SIGKILL) once it had opened its marker for writing left it empty, and the rerun
    failed with `json.decoder.JSONDecodeError: Expecting value: line 1 column 1 (char 0)`. Now the marker is written
    whole or not at all, and the earlier warm start's marker is gone before the new weights are saved over its own:
    the rerun warm-starts again."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    child = """
import builtins, os, signal, sys
sys.path.insert(0, sys.argv[1])
from conftest import DEMO_TINY
from opefo_trl.demo import DemoSettings, warm_start

real_open = builtins.open

def open_then_die(file, mode="r", *args, **kwargs):
    handle = real_open(file, mode, *args, **kwargs)
    if "w" in mode and "demo_warm_start.json" in os.fspath(file):
        os.kill(os.getpid(), signal.SIGKILL)
    return handle

builtins.open = open_then_die
warm_start(sys.argv[2], DemoSettings(**{**DEMO_TINY, "warm_start_steps": 4}), "threads1")
"""
    settings = tiny_settings(warm_start_steps=3)
    path = warm_start(str(tmp_path), settings, "threads1", log=lambda _: None)  # an earlier one, with its marker
    tests = Path(__file__).parents[1]
    environment = {**os.environ, "PYTHONPATH": str(tests.parent)}
    killed = subprocess.run([sys.executable, "-c", child, str(tests), str(tmp_path)], env=environment)
    assert killed.returncode == -signal.SIGKILL
    folder = tmp_path / "models" / "warm_start-digit_sum-threads1"
    assert (folder / "model.safetensors").is_file()  # killed after saving the model, writing the marker

    messages = []  # the folder holds the 4-step weights: the 3-step warm start is not taken for them
    assert warm_start(str(tmp_path), settings, "threads1", log=messages.append) == path == str(folder)
    assert not any("reusing" in m for m in messages)
    assert json.loads((folder / WARM_START_MARKER).read_text())["settings"]["warm_start_steps"] == 3


@pytest.mark.parametrize("text", ['{"settings": {"task": "digit_su', "[]"])
def test_an_unreadable_marker_is_one_line_and_the_warm_start_is_done_again(text, tmp_path, tiny_settings):
    """T: `json.decoder.JSONDecodeError` for a cut marker (what a kill left before markers were written atomically),
    `AttributeError: 'list' object has no attribute 'get'` for one of another shape."""
    settings = tiny_settings(warm_start_steps=4)
    path = warm_start(str(tmp_path), settings, "threads1", log=lambda _: None)
    marker = tmp_path / "models" / "warm_start-digit_sum-threads1" / WARM_START_MARKER
    marker.write_text(text)
    messages = []
    assert warm_start(str(tmp_path), settings, "threads1", log=messages.append) == path
    assert messages[0].startswith(f"warm start: its marker {marker} is not readable (")
    assert messages[0].endswith("): warm-starting again")
    assert not any("reusing" in m for m in messages)
    assert json.loads(marker.read_text())["settings"]["warm_start_steps"] == 4
