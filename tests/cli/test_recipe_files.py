"""Recipes built on a base (`base: base.yaml`): merged key by key before TRL's parser reads them, every file's keys
checked and named, one-line errors for a missing or cyclic base."""

import os

import pytest

from opefo_trl.cli import train
from opefo_trl.cli.recipe_files import load_recipe, read_recipe_chain


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def test_a_recipe_replaces_its_bases_keys_and_bases_chain(tmp_path):
    write(
        tmp_path / "bases" / "root.yaml",
        "learning_rate: 1.0e-6\nnum_generations: 8\nseed: 1\nenv: {A: root, B: root}\n",
    )
    write(tmp_path / "bases" / "mid.yaml", "base: root.yaml\nnum_generations: 4\nenv: {B: mid}\n")
    recipe = write(tmp_path / "run" / "leaf.yaml", "base: ../bases/mid.yaml\nseed: 3\nmethod: grpo\n")
    assert load_recipe(recipe) == {
        "learning_rate": 1e-6,
        "num_generations": 4,
        "seed": 3,
        "method": "grpo",
        "env": {"A": "root", "B": "mid"},  # merged per variable
    }
    chain = read_recipe_chain(recipe)
    assert [os.path.basename(path) for path, _ in chain] == ["root.yaml", "mid.yaml", "leaf.yaml"]
    assert all("base" not in values for _, values in chain)


def test_opefo_train_reads_the_merged_recipe_and_the_command_line_wins(tmp_path, tiny_model_path, monkeypatch):
    monkeypatch.delenv("OPEFO_TEST_BASE_ENV", raising=False)
    write(
        tmp_path / "base.yaml",
        f"model_name_or_path: {tiny_model_path}\nlearning_rate: 1.0e-6\nmax_completion_length: 64\nseed: 5\n"
        "env: {OPEFO_TEST_BASE_ENV: from-base}\n",
    )
    recipe = write(tmp_path / "grpo.yaml", "base: base.yaml\nmethod: grpo\nlearning_rate: 2.0e-6\n")
    argv = ["--config", recipe, "--use_cpu", "true", "--seed", "9", "--output_dir", str(tmp_path / "out")]
    _, args, model_args = train.parse_args(argv)
    assert (args.method, args.learning_rate, args.max_completion_length, args.seed) == ("grpo", 2e-6, 64, 9)
    assert model_args.model_name_or_path == tiny_model_path
    assert os.environ["OPEFO_TEST_BASE_ENV"] == "from-base"


@pytest.mark.parametrize(
    "files, recipe, message",
    [
        (
            {"r.yaml": "base: nope.yaml\nseed: 1\n"},
            "r.yaml",
            "Recipe file '{d}/r.yaml': its base 'nope.yaml' does not exist (looked for '{d}/nope.yaml'; a base is "
            "relative to the recipe's folder). A recipe copied out of its folder needs its base too: copy the base "
            "recipe to '{d}/nope.yaml', or set `base:` to the base recipe's path (absolute, or relative to '{d}').",
        ),
        (
            {"a.yaml": "base: b.yaml\n", "b.yaml": "base: a.yaml\n"},
            "a.yaml",
            "Recipe file '{d}/a.yaml': its bases form a cycle ({d}/a.yaml -> {d}/b.yaml -> {d}/a.yaml); remove one "
            "base.",
        ),
        (
            {"self.yaml": "base: self.yaml\nseed: 1\n"},
            "self.yaml",
            "Recipe file '{d}/self.yaml': its bases form a cycle ({d}/self.yaml -> {d}/self.yaml); remove one base.",
        ),
        (
            {"r.yaml": "base: [b.yaml]\n"},
            "r.yaml",
            "Recipe file '{d}/r.yaml': `base: ['b.yaml']` is not a path; give the base recipe's file, relative to "
            "this recipe's folder (e.g. `base: base.yaml`).",
        ),
        (
            {"r.yaml": "base: b.yaml\n", "b.yaml": "- seed: 1\n"},
            "r.yaml",
            "Recipe file '{d}/b.yaml' must contain a YAML mapping of option: value.",
        ),
        (
            {"r.yaml": "base: b.yaml\n", "b.yaml": "seed: 1\nseed: 2\n"},
            "r.yaml",
            "Recipe file '{d}/b.yaml': key 'seed' is given twice (lines 1 and 2); keep one.",
        ),
    ],
)
def test_a_bad_base_is_one_line_naming_the_file(files, recipe, message, tmp_path, capsys):
    for name, text in files.items():
        write(tmp_path / name, text)
    assert train.main(["--config", str(tmp_path / recipe)]) == 2
    assert capsys.readouterr().err == f"opefo-train: error: {message.format(d=tmp_path)}\n"


def test_unknown_keys_and_wrong_types_are_named_in_the_file_that_holds_them(tmp_path, capsys):
    base = write(tmp_path / "base.yaml", "learning_rat: 1.0e-6\n")
    recipe = write(tmp_path / "r.yaml", "base: base.yaml\nnum_generation: 4\n")
    assert train.main(["--config", recipe]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"opefo-train: error: Unknown key(s) in recipe '{base}': 'learning_rat' (did you mean")
    write(tmp_path / "base.yaml", "max_steps: 2.5\n")
    assert train.main(["--config", recipe]) == 2
    assert f"in recipe '{recipe}': 'num_generation' (did you mean 'num_generations'" in capsys.readouterr().err
    write(tmp_path / "r.yaml", "base: base.yaml\nseed: 1\n")
    assert train.main(["--config", recipe]) == 2
    assert capsys.readouterr().err.startswith(f"opefo-train: error: Recipe '{base}': `max_steps: 2.5` is a float")


def test_a_shipped_recipe_copied_elsewhere_names_where_it_looked_and_the_fix(tmp_path, capsys):
    """A shipped recipe copied out of recipes/<model>/ failed with "its base 'base.yaml' does not exist" only."""
    import shutil

    shipped = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "qwen2.5-math-7b")
    copy = shutil.copy(os.path.join(shipped, "opefo.yaml"), tmp_path / "opefo.yaml")
    assert train.main(["--config", str(copy)]) == 2
    err = capsys.readouterr().err
    assert f"its base 'base.yaml' does not exist (looked for '{tmp_path / 'base.yaml'}'; " in err
    assert f"copy the base recipe to '{tmp_path / 'base.yaml'}', or set `base:` to the base recipe's path" in err
    shutil.copy(os.path.join(shipped, "base.yaml"), tmp_path / "base.yaml")  # the fix it names
    assert load_recipe(str(copy)) == load_recipe(os.path.join(shipped, "opefo.yaml"))


@pytest.mark.parametrize("recipe", ["own", "base"])
def test_a_recipe_that_is_not_utf8_is_one_line_naming_the_file(recipe, tmp_path, capsys):
    """A Latin-1 recipe gave "'utf-8' codec can't decode byte 0xe9 ..." without naming the file."""
    bad = tmp_path / f"{recipe}.yaml"
    bad.write_bytes("seed: 1\n# caf\u00e9\n".encode("latin-1"))
    if recipe == "base":
        write(tmp_path / "r.yaml", "base: base.yaml\n")
    assert train.main(["--config", str(tmp_path / ("r.yaml" if recipe == "base" else "own.yaml"))]) == 2
    assert capsys.readouterr().err == (
        f"opefo-train: error: Recipe file '{bad}' is not UTF-8 text (byte e9 at offset 13): save it as UTF-8.\n"
    )
