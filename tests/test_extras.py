"""The optional dependencies: without one, the reward, the CLIs and the demo stop before any work with one error
naming the extra to install (a missing module is simulated with a `None` entry in `sys.modules`)."""

import importlib
import sys

import pytest

from opefo_trl._extras import missing_extra_message, needs_extra, require_extra


def _hide(monkeypatch, *modules):
    """Make `import module` raise ModuleNotFoundError, as when it is not installed."""
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)


def test_a_missing_module_is_reported_with_the_extra_that_installs_it(monkeypatch):
    _hide(monkeypatch, "matplotlib")
    with pytest.raises(ImportError, match=r"^opefo-plot needs matplotlib, .* `pip install 'opefo-trl\[plot\]'`") as err:
        require_extra("plot", "matplotlib", "opefo-plot")
    assert err.value.name == "matplotlib" and isinstance(err.value.__cause__, ModuleNotFoundError)


def test_another_missing_module_is_not_blamed_on_the_extra(monkeypatch):
    # math-verify installed but one of its own dependencies missing: the real error, not "install the extra".
    _hide(monkeypatch, "latex2sympy2_extended")
    with pytest.raises(ModuleNotFoundError) as err, needs_extra("math", "math_verify", "The reward"):
        import latex2sympy2_extended  # noqa: F401
    assert "opefo-trl[math]" not in str(err.value)


def test_an_unknown_extra_is_refused():
    with pytest.raises(ValueError, match=r"Unknown extra 'plots': choose one of \['math', 'plot', 'real-model'\]"):
        require_extra("plots", "matplotlib", "x")


def test_the_math_verify_reward_names_the_math_extra(monkeypatch):
    _hide(monkeypatch, "math_verify")
    monkeypatch.delitem(sys.modules, "opefo_trl.data.rewards", raising=False)
    with pytest.raises(ImportError, match=r"math_accuracy_reward\) needs math-verify.*opefo-trl\[math\]"):
        importlib.import_module("opefo_trl.data.rewards")
    # What needs no math-verify still loads: the data sets' gold answers are read without it.
    from opefo_trl.data.loading import _plain_answer

    assert _plain_answer(["$1$", 2]) == "1, 2"


def test_opefo_train_names_the_math_extra_before_loading_the_model(
    monkeypatch, tiny_model_path, problems_file, tmp_path, capsys
):
    from opefo_trl.cli.train import main

    _hide(monkeypatch, "math_verify")
    monkeypatch.delitem(sys.modules, "opefo_trl.data.rewards", raising=False)
    loads = []
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", lambda *a, **k: loads.append(a))
    argv = ["--model_name_or_path", tiny_model_path, "--dataset_files", problems_file, "--output_dir", str(tmp_path)]
    assert main([*argv, "--use_cpu", "true", "--bf16", "false", "--num_generations", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("opefo-train: error: The math-verify reward") and "opefo-trl[math]" in err
    assert loads == [] and "Traceback" not in err


def test_opefo_eval_names_the_math_extra_before_loading_the_model(monkeypatch, tiny_model_path, tmp_path, capsys):
    from opefo_trl.cli.evaluate import main

    _hide(monkeypatch, "math_verify")
    argv = ["--model_name_or_path", tiny_model_path, "--output_dir", str(tmp_path / "eval")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"opefo-eval: error: {missing_extra_message('math', 'opefo-eval (scoring answers)')}\n"
    assert not (tmp_path / "eval").exists()


def test_opefo_plot_names_the_plot_extra(monkeypatch, tmp_path, capsys):
    from opefo_trl.cli.plot import main

    _hide(monkeypatch, "matplotlib")
    assert main([str(tmp_path / "run"), "--output", str(tmp_path / "curves.png")]) == 2
    assert capsys.readouterr().err == f"opefo-plot: error: {missing_extra_message('plot', 'opefo-plot')}\n"


def test_the_demo_names_the_plot_extra_before_training(monkeypatch, tmp_path, capsys):
    from opefo_trl.demo import runner

    _hide(monkeypatch, "matplotlib")
    monkeypatch.setattr(runner, "warm_start", lambda *a, **k: pytest.fail("the demo trained without matplotlib"))
    assert runner.main(["--quick", "true", "--output_dir", str(tmp_path / "demo")]) == 2
    err = capsys.readouterr().err
    assert err == f"python -m opefo_trl.demo: error: {missing_extra_message('plot', 'The demo (its curves)')}\n"
