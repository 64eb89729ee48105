"""opefo-train and opefo-eval parse options alike (opefo_trl.cli.options): recipes, flags, typos, --help."""

import os

import pytest
from conftest import flat_recipe_text

from opefo_trl.cli import evaluate, train
from opefo_trl.cli.options import build_parser, parse_options

RECIPE = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "qwen2.5-math-7b", "opefo.yaml")
RECIPE_TEXT = flat_recipe_text(RECIPE)  # report_to: trackio; the tests that pass it run with --report_to none


@pytest.fixture(params=["opefo-train", "opefo-eval"])
def command(request, tmp_path):
    """(prog, main, a valid recipe's text, valid flags): both commands get the same bad input."""
    if request.param == "opefo-train":
        return "opefo-train", train.main, RECIPE_TEXT, ["--use_cpu", "true"]
    return "opefo-eval", evaluate.main, "model_name_or_path: m\nbenchmarks: [aime24]\n", ["--num_samples", "4"]


def test_unknown_recipe_key_is_refused_with_a_hint(command, tmp_path, capsys):
    prog, main, recipe_text, flags = command
    recipe = tmp_path / "typo.yaml"
    recipe.write_text(recipe_text + "\ntemprature: 0.5\nmax_new_tokns: 10\n")
    assert main(["--config", str(recipe), *flags]) == 2
    err = capsys.readouterr().err
    assert f"{prog}: error: Unknown key(s) in recipe '{recipe}': 'temprature' (did you mean " in err
    assert "'temperature'" in err.split(";")[0] and "'max_new_tokns'" in err
    assert f"`{prog} --help` lists every option; remove or fix them." in err


def test_unknown_flag_is_refused_with_a_hint(command, tmp_path, capsys):
    prog, main, recipe_text, flags = command
    recipe = tmp_path / "ok.yaml"
    recipe.write_text(recipe_text)
    for typo in (["--temprature", "0.5"], ["--temprature=0.5"]):
        assert main(["--config", str(recipe), *flags, *typo]) == 2
        err = capsys.readouterr().err
        assert f"{prog}: error: Unknown option(s) on the command line: 'temprature' (did you mean " in err
        assert "'temperature'" in err and f"`{prog} --help` lists every option; remove or fix it." in err


def test_abbreviations_are_refused(command, tmp_path, capsys):
    prog, main, recipe_text, flags = command
    recipe = tmp_path / "ok.yaml"
    recipe.write_text(recipe_text)
    # argparse would silently read `--temp` as `--temperature`.
    assert main(["--config", str(recipe), *flags, "--temp", "0.5"]) == 2
    assert "Unknown option(s) on the command line: 'temp'" in capsys.readouterr().err


def test_help_lists_the_config_flag_and_snake_case_options(command, capsys):
    prog, main, _, _ = command
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {prog}") and "--config RECIPE_YAML" in out
    assert "--temperature TEMPERATURE" in out and "--model_name_or_path MODEL_NAME_OR_PATH" in out


def test_missing_or_malformed_recipe(command, tmp_path, capsys):
    prog, main, _, _ = command
    assert main(["--config", str(tmp_path / "none.yaml")]) == 2
    assert f"{prog}: error: Recipe file '{tmp_path / 'none.yaml'}' does not exist" in capsys.readouterr().err
    assert main(["--config"]) == 2
    assert "`--config` needs the path of a recipe YAML file" in capsys.readouterr().err
    listed = tmp_path / "list.yaml"
    listed.write_text("- temperature: 0.5\n")
    assert main(["--config", str(listed)]) == 2
    assert "must contain a YAML mapping" in capsys.readouterr().err
    broken = tmp_path / "broken.yaml"
    broken.write_text("temperature: [0.5\n")
    assert main([f"--config={broken}"]) == 2
    assert f"Recipe file '{broken}' is not valid YAML" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------------------
# The helper itself
# ----------------------------------------------------------------------------------------------------------------------


def _parser():
    from dataclasses import dataclass, field

    @dataclass
    class Options:
        learning_rate: float = 1e-6
        reward_funcs: list[str] = field(default_factory=lambda: ["a"])

    return build_parser([Options], prog="tool")


def test_recipe_then_command_line_and_config_equals_form(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("learning_rate: 3.0e-6\nreward_funcs: [x, y]\nenv:\n  OPEFO_TEST_OPTIONS_ENV: set\n")
    (options,) = parse_options(_parser(), ["--config", str(recipe)])
    assert (options.learning_rate, options.reward_funcs) == (3e-6, ["x", "y"])
    assert os.environ.pop("OPEFO_TEST_OPTIONS_ENV") == "set"  # TRL's `env:` mapping still works
    (options,) = parse_options(_parser(), [f"--config={recipe}", "--learning_rate", "1e-5"])
    assert options.learning_rate == 1e-5  # the command line overrides the recipe
    with pytest.raises(ValueError, match="`--config` was given twice"):
        parse_options(_parser(), ["--config", str(recipe), f"--config={recipe}"])


def test_stray_values_are_explained():
    with pytest.raises(ValueError, match=r"Unexpected value\(s\) on the command line: \['z'\]. Options take the form"):
        parse_options(_parser(), ["--learning_rate", "1e-5", "z"])


@pytest.mark.parametrize(
    "argv, stray",
    [
        (["--learning_rate", "1e-5", "z"], ["z"]),
        (["a", "--learning_rate", "1e-5"], ["a"]),
        (["--learning_rate", "1e-5", "-3"], ["-3"]),  # a negative number no flag takes
        (["--learning_rate", "1e-5", "-x"], ["-x"]),  # no option is spelt -x
        (["--reward_funcs", "a", "b", "--learning_rate", "2", "c"], ["c"]),
    ],
)
def test_stray_values_are_refused_before_trl_parses_anything(argv, stray, monkeypatch):
    parser = _parser()

    def trl_parses(*args, **kwargs):
        raise AssertionError("TRL's parser was reached: it would raise its own unknown-argument error")

    monkeypatch.setattr(parser, "parse_args_and_config", trl_parses)
    with pytest.raises(ValueError) as error:
        parse_options(parser, argv)
    assert str(error.value) == (
        f"Unexpected value(s) on the command line: {stray}. Options take the form `--name value`; a list option "
        "takes its values after one flag (`--name a b`)."
    )


def test_values_argparse_takes_are_not_stray():
    (options,) = parse_options(_parser(), ["--reward_funcs", "a", "-", "--learning_rate", "-1"])
    assert (options.reward_funcs, options.learning_rate) == (["a", "-"], -1.0)


def test_other_errors_are_left_alone():
    from dataclasses import dataclass

    @dataclass
    class Checked:
        learning_rate: float = 1e-6

        def __post_init__(self):
            if self.learning_rate <= 0:
                raise ValueError("learning_rate must be > 0")

    with pytest.raises(ValueError, match="^learning_rate must be > 0$"):
        parse_options(build_parser([Checked], prog="t"), ["--learning_rate", "0"])
    with pytest.raises(SystemExit):  # argparse's own type error, as before
        parse_options(build_parser([Checked], prog="t"), ["--learning_rate", "fast"])


def test_recipe_values_are_checked_against_the_declared_types(tmp_path):
    from dataclasses import dataclass, field

    @dataclass
    class Typed:
        max_steps: int = -1
        learning_rate: float = 1e-6
        use_vllm: bool = False
        run_name: str | None = None
        num_generations: int | None = 8
        reward_funcs: list[str] = field(default_factory=lambda: ["a"])
        weights: list[float] | None = None
        kwargs: dict | str | None = None

    parser = build_parser([Typed], prog="tool")
    recipe = tmp_path / "r.yaml"
    # What YAML gives and the options take: ints for floats, text anywhere (argparse converts it), a mapping for a
    # dict option, one value for a list option, null for an optional one.
    recipe.write_text(
        "max_steps: 3\nlearning_rate: 1\nuse_vllm: true\nrun_name: 42\nnum_generations: null\nreward_funcs: x\n"
        "weights: [1, 0.5]\nkwargs: {a: 1}\n"
    )
    (options,) = parse_options(parser, ["--config", str(recipe)])
    assert (options.max_steps, options.learning_rate, options.reward_funcs, options.kwargs) == (3, 1, "x", {"a": 1})
    recipe.write_text("max_steps: 2.0\nuse_vllm: 1\nweights: [1, x]\nrun_name: [a]\nkwargs: [1]\n")
    with pytest.raises(ValueError) as error:
        parse_options(parser, ["--config", str(recipe)])
    assert str(error.value) == (
        f"Recipe '{recipe}': `max_steps: 2.0` is a float, but max_steps takes an integer (e.g. `max_steps: 2`); "
        "`use_vllm: 1` is an int, but use_vllm takes true or false; `weights: [1, 'x']` is a list, but weights takes "
        "a list of numbers or null; `run_name: ['a']` is a list, but run_name takes text or null (e.g. "
        "`run_name: a`); `kwargs: [1]` is a list, but kwargs takes a mapping or text or null (e.g. `kwargs: 1`)."
    )


def test_unknown_names_are_reported_before_any_value_is_checked(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("learning_rat: 1\nreward_funcs: 3\nlearning_rate: [1]\n")
    with pytest.raises(ValueError, match=r"^Unknown key\(s\) in recipe .*'learning_rat'"):
        parse_options(_parser(), ["--config", str(recipe)])
    recipe.write_text("learning_rate: [1]\n")
    with pytest.raises(ValueError, match=r"^Unknown option\(s\) on the command line: 'lr'"):
        parse_options(_parser(), ["--config", str(recipe), "--lr", "1"])


def test_package_logs_go_to_stderr_as_it_is_when_they_are_logged(monkeypatch):
    """A CLI's main may run again after stderr was replaced (a notebook cell, a test capturing output)."""
    import io
    import logging
    import sys

    from opefo_trl.cli.options import show_package_logs

    package_logger = logging.getLogger("opefo_trl")
    monkeypatch.setattr(package_logger, "handlers", [])
    monkeypatch.setattr(package_logger, "level", logging.NOTSET)
    monkeypatch.setenv("RANK", "0")
    show_package_logs("opefo-train")
    show_package_logs("opefo-train")  # once only
    assert len(package_logger.handlers) == 1 and package_logger.level == logging.INFO
    for text in ("first", "second"):
        stderr = io.StringIO()
        monkeypatch.setattr(sys, "stderr", stderr)
        logging.getLogger("opefo_trl.data").info(text)
        assert stderr.getvalue().endswith(f"[opefo-train] {text}\n")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(package_logger, "handlers", [])
    show_package_logs("opefo-train")
    assert package_logger.level == logging.WARNING  # INFO from the main process only
