"""benchmarks/trl_grpo_tests.py: TRL's GRPO tests run with `OPEFOTrainer` swapped in (the swap, the outcomes read
back, the comparison with TRL's own), checked on a stand-in test module rather than TRL's (not installed here)."""

import pickle
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import trl_grpo_tests  # noqa: E402

from opefo_trl import OPEFOConfig, OPEFOTrainer  # noqa: E402

#: A stand-in for TRL's test module: what each mode must see when it imports TRL's classes, one failing and one
#: skipped test, and a probe of a package TRL does not have imported by ``testing_utils``.
STAND_IN_TESTS = """
import os

from trl import GRPOConfig, GRPOTrainer
from opefo_trl import OPEFOTrainer
from .testing_utils import is_nonexistent_package_available

MODE = os.environ["OPEFO_TRL_GRPO_TESTS_MODE"]


def test_the_classes_of_the_mode(tmp_path):
    assert (GRPOTrainer is OPEFOTrainer) == (MODE != "trl")
    method = getattr(GRPOConfig(output_dir=str(tmp_path), bf16=False), "method", None)
    assert method == {"trl": None, "grpo": "grpo", "default": "opefo"}[MODE]


def test_fails():
    raise ValueError("refused here\\nsecond line")


def test_skipped():
    import pytest

    pytest.skip("needs a GPU")


def test_probe_of_a_missing_package_says_it_is_missing():
    assert is_nonexistent_package_available() is False
"""


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory):
    work = tmp_path_factory.mktemp("trl-tests")
    (work / "tests").mkdir()
    (work / "tests" / "__init__.py").write_text("")
    (work / "tests" / "testing_utils.py").write_text("from trl.import_utils import is_nonexistent_package_available\n")
    (work / "tests" / "test_grpo_trainer.py").write_text(textwrap.dedent(STAND_IN_TESTS))
    return work


@pytest.mark.parametrize("mode", trl_grpo_tests.MODES)
def test_each_mode_imports_its_classes_and_every_outcome_is_read_back(work_dir, mode):
    outcomes = trl_grpo_tests.run_mode(mode, work_dir, keyword=None, timeout_s=300)
    by_name = {test_id.split("::")[-1]: o for test_id, o in outcomes.items()}
    assert {name: o["outcome"] for name, o in by_name.items()} == {
        "test_the_classes_of_the_mode": "passed",
        "test_fails": "failed",
        "test_skipped": "skipped",
        "test_probe_of_a_missing_package_says_it_is_missing": "passed",
    }
    assert by_name["test_fails"]["message"] == "ValueError: refused here"


def test_the_comparison_counts_only_what_passes_in_trl():
    passed, failed = {"outcome": "passed", "message": ""}, {"outcome": "failed", "message": "ValueError: no"}
    results = {
        "trl": {"a": passed, "b": passed, "c": failed, "d": {"outcome": "skipped", "message": ""}},
        "grpo": {"a": passed, "b": failed, "c": passed},
    }
    summary = trl_grpo_tests.compare(results)
    assert summary["baseline"] == {"failed": 1, "passed": 2, "skipped": 1}
    assert summary["modes"]["grpo"] == {
        "baseline_passing": 2,
        "passing": 1,
        "not_passing": {"b": failed},
        "passing_only_here": ["c"],
    }
    results["grpo"].pop("a")  # a test the swapped run never reported is not passing
    assert trl_grpo_tests.compare(results)["modes"]["grpo"]["not_passing"]["a"]["outcome"] == "missing"


def test_the_grpo_mode_config_is_opefo_config_with_grpo_as_its_default_and_pickles(tmp_path):
    config_class = trl_grpo_tests.grpo_method_config()
    config = config_class(output_dir=str(tmp_path), bf16=False)
    assert isinstance(config, OPEFOConfig) and config.method == "grpo"
    assert OPEFOConfig(output_dir=str(tmp_path), bf16=False).method == "opefo"  # the library's own default is untouched
    assert pickle.loads(pickle.dumps(config)).method == "grpo"
    assert OPEFOTrainer is not None


def test_the_zen_prompts_are_the_zen_of_python():
    lines = trl_grpo_tests.zen_lines()
    assert len(lines) == 19
    assert lines[0] == "Beautiful is better than ugly."
