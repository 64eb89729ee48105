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
