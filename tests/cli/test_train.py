"""`opefo-train` end to end, in-process through `main(argv)`: parsing, validation before model loading, rewards,
metrics file, checkpoint / resume with method state."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import flat_recipe_text

from opefo_trl.cli.train import main, parse_args
from opefo_trl.runs import CHECKPOINT_MARKER, LOCK_NAME, MANIFEST_NAME, METHOD_STATE_NAME, record_in_manifest

RECIPE = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "qwen2.5-math-7b", "opefo.yaml")
RECIPE_TEXT = flat_recipe_text(RECIPE)  # report_to: trackio; the tests that pass it run with --report_to none
PAR_RECIPE = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "qwen2.5-math-7b", "par.yaml")

REWARD_MODULE = '''
SEEN_SOLUTIONS = []


def digit_overlap_reward(completions, solution, **kwargs):
    """Fraction of the gold answer's digits that occur in the completion: varied rewards from a random model."""
    SEEN_SOLUTIONS.extend(solution)
    rewards = []
    for completion, gold in zip(completions, solution):
        text = completion[-1]["content"]
        rewards.append(sum(d in text for d in set(gold)) / len(set(gold)))
    return rewards


def text_length_reward(completions, **kwargs):
    """The completion's length in characters / 32: rewards that differ within a group from the first step."""
    return [len(completion[-1]["content"]) / 32 for completion in completions]
'''


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    """A reward function importable by dotted path (`opefo_cli_test_rewards.digit_overlap_reward`)."""
    (tmp_path / "opefo_cli_test_rewards.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    module = importlib.import_module("opefo_cli_test_rewards")
    yield module
    import sys

    sys.modules.pop("opefo_cli_test_rewards", None)


def _cpu_overrides(model_path, data_file, output_dir, **extra):
    """Recipe overrides for a CPU run on the tiny model: no vLLM / bf16, 4 prompts x 2 completions per step."""
    args = {
        "model_name_or_path": model_path,
        "dataset_files": data_file,
        "output_dir": output_dir,
        "use_vllm": "false",
        "bf16": "false",
        "use_cpu": "true",
        "num_generations": "2",
        "per_device_train_batch_size": "4",
        "gradient_accumulation_steps": "2",
        "max_completion_length": "8",
        "max_steps": "1",
        "report_to": "none",
        **{k: str(v) for k, v in extra.items()},
    }
    argv = []
    for key, value in args.items():
        argv += [f"--{key}", *value.split(" ")]
    return argv


def _metrics(output_dir, name="metrics.jsonl"):
    with open(os.path.join(output_dir, name)) as f:
        return [json.loads(line) for line in f]


@pytest.fixture
def no_model_loading(monkeypatch):
    """Fail the test if the trainer (which loads the model weights) is ever constructed."""
    import opefo_trl.trainer

    class ModelLoadingReached(AssertionError):
        pass

    def refuse(*args, **kwargs):
        raise ModelLoadingReached("the model was about to be loaded before the error was raised")

    monkeypatch.setattr(opefo_trl.trainer, "OPEFOTrainer", refuse)
    return ModelLoadingReached


# ----------------------------------------------------------------------------------------------------------------------
# Parsing
# ----------------------------------------------------------------------------------------------------------------------


def test_help_lists_every_option_group(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for option in (
        "--dataset_name",
        "--prompt_template",
        "--reward_funcs",
        "--drop_overlong_prompts",  # script
        "--model_name_or_path",
        "--use_peft",
        "--lora_r",  # ModelConfig
        "--method",
        "--opefo_lambda",
        "--par_coef",
        "--kl_cov_ratio",  # OPEFOConfig
        "--num_generations",
        "--steps_per_generation",
        "--resume_from_checkpoint",
        "--dataset_train_split",
        "--dataset_streaming",  # TRL's ScriptArguments
    ):  # GRPOConfig
        assert option in out, option
    assert "--config RECIPE_YAML" in out
    # OPEFO's options first, `method` leading; then the data and rewards, the model, the rest of GRPOConfig.
    headers = [
        "OPEFO: the method and the entropy flow",
        "data, prompt and rewards (TRL's ScriptArguments",
        "model (trl.ModelConfig)",
        "training (GRPOConfig and transformers' TrainingArguments)",
    ]
    lines = out.splitlines()
    starts = [next(i for i, line in enumerate(lines) if line.startswith(header)) for header in headers]
    assert starts == sorted(starts) and starts[0] < 12 and lines[starts[0] + 1].startswith("  --method ")
    for option, group in (
        ("--opefo_lambda", 0),
        ("--dataset_train_split", 1),
        ("--lora_r", 2),
        ("--num_generations", 3),
    ):
        at = next(i for i, line in enumerate(lines) if line.startswith(f"  {option} "))
        assert starts[group] < at < (starts + [len(lines)])[group + 1], option


def test_recipe_values_and_cli_overrides(tiny_model_path):
    overrides = ["--learning_rate", "5e-6", "--model_name_or_path", tiny_model_path]
    script_args, training_args, model_args = parse_args(
        ["--config", RECIPE, "--use_cpu", "true", "--report_to", "none", *overrides]
    )
    assert training_args.method == "opefo"
    assert training_args.learning_rate == 5e-6  # CLI beats recipe (2.83e-6)
    assert training_args.max_completion_length == 3000  # from the recipe
    assert model_args.model_name_or_path == tiny_model_path
    assert script_args.dataset_name == "dapo-math-17k" and script_args.reward_funcs == ["math_accuracy_reward"]


def test_unknown_recipe_key_is_an_error_naming_it(tmp_path):
    recipe = tmp_path / "typo.yaml"
    recipe.write_text(RECIPE_TEXT + "\nlearning_rat: 1.0e-6\nnum_generation: 4\n")
    with pytest.raises(ValueError) as err:
        parse_args(["--config", str(recipe), "--use_cpu", "true"])
    message = str(err.value)
    assert "'learning_rat' (did you mean 'learning_rate'" in message
    assert "'num_generation' (did you mean 'num_generations'" in message
    assert str(recipe) in message


def test_unknown_cli_option_is_an_error_not_an_abbreviation():
    # argparse would silently expand `--num_generation` to `--num_generations`; opefo-train refuses prefixes.
    with pytest.raises(ValueError, match=r"Unknown option\(s\) on the command line: 'num_generation' \(did you mean"):
        parse_args(["--config", RECIPE, "--use_cpu", "true", "--num_generation", "4"])


def test_misspelt_choice_in_recipe_is_an_error(tmp_path):
    recipe = tmp_path / "bad_method.yaml"
    recipe.write_text(RECIPE_TEXT.replace("method: opefo", "method: opfeo"))
    with pytest.raises(ValueError, match="opfeo"):
        parse_args(["--config", str(recipe), "--use_cpu", "true"])
    recipe.write_text(RECIPE_TEXT.replace("metrics_jsonl: main_process", "metrics_jsonl: everywhere"))
    with pytest.raises(ValueError, match=r"metrics_jsonl must be one of .*'everywhere'"):
        parse_args(["--config", str(recipe), "--use_cpu", "true"])


def test_nonexistent_recipe_is_a_clear_error(no_model_loading, capsys):
    assert main(["--config", "recipes/no-such-model/opefo.yaml"]) == 2
    err = capsys.readouterr().err
    assert "opefo-train: error: Recipe file 'recipes/no-such-model/opefo.yaml' does not exist" in err
    with pytest.raises(FileNotFoundError, match="does not exist"):
        parse_args(["--config", "recipes/no-such-model/opefo.yaml"])


@pytest.mark.parametrize("value, expected", [("true", True), ("false", None), ("checkpoint", "path")])
def test_resume_from_checkpoint_in_recipe(value, expected, tmp_path, write_checkpoint):
    out = tmp_path / "run"
    write_checkpoint(out, 7)
    recipe = tmp_path / "resume.yaml"
    setting = str(out / "checkpoint-7") if value == "checkpoint" else value
    recipe.write_text(RECIPE_TEXT + f"\nresume_from_checkpoint: {setting}\n")
    # Not resuming into an output_dir that holds a checkpoint takes overwrite_output_dir (see the tests below).
    overwrite = ["--overwrite_output_dir", "true"] if expected is None else []
    argv = ["--config", str(recipe), "--use_cpu", "true", "--report_to", "none", "--output_dir", str(out), *overwrite]
    _, training_args, _ = parse_args(argv)
    assert training_args.resume_from_checkpoint == (setting if expected == "path" else expected)


def test_single_value_for_a_list_option_in_recipe(tmp_path, problems_file):
    recipe = tmp_path / "single.yaml"
    text = RECIPE_TEXT.replace("reward_funcs: [math_accuracy_reward]", "reward_funcs: math_accuracy_reward")
    recipe.write_text(text + f"\ndataset_files: {problems_file}\n")
    script_args, _, _ = parse_args(["--config", str(recipe), "--use_cpu", "true", "--report_to", "none"])
    assert script_args.dataset_files == [problems_file] and script_args.reward_funcs == ["math_accuracy_reward"]


def test_non_mapping_recipe_is_a_clear_error(tmp_path):
    recipe = tmp_path / "list.yaml"
    recipe.write_text("- method: opefo\n")
    with pytest.raises(ValueError, match="must contain a YAML mapping"):
        parse_args(["--config", str(recipe)])


@pytest.mark.parametrize("report_to", ["trackio", "[tensorboard, trackio]"])
def test_a_tracker_that_is_not_installed_is_refused_before_loading(
    report_to, tiny_model_path, problems_file, tmp_path, no_model_loading, monkeypatch, capsys
):
    """The recipes log to trackio: without it, one line saying how to install it or turn it off."""
    from transformers.integrations import integration_utils

    monkeypatch.setattr(integration_utils, "get_available_reporting_integrations", lambda: ["tensorboard"])
    recipe = tmp_path / "tracked.yaml"
    recipe.write_text(f"base: {os.path.abspath(RECIPE)}\nreport_to: {report_to}\n")
    overrides = _cpu_overrides(tiny_model_path, problems_file, str(tmp_path / "out"))
    tracker_off = overrides.index("--report_to")
    assert overrides[tracker_off : tracker_off + 2] == ["--report_to", "none"]
    assert main(["--config", str(recipe), *overrides[:tracker_off], *overrides[tracker_off + 2 :]]) == 2
    assert capsys.readouterr().err == (
        "opefo-train: error: report_to names 'trackio' (TrackioCallback requires trackio to be installed. Run `pip "
        "install trackio`.), which cannot log here: install what it names, or turn the tracker off with `--report_to "
        "none` (metrics.jsonl in output_dir is written either way).\n"
    )
    assert parse_args(["--config", str(recipe), *overrides])[1].report_to == []


@pytest.mark.parametrize(
    ("report_to", "expected"),
    [
        ("wandbb", "report_to names 'wandbb' (did you mean 'wandb'?), which transformers does not log to; give none, "),
        ("dvclive", "report_to names 'dvclive' (DVCLiveCallback requires dvclive to be installed. Run `pip install "),
        ("codecarbon", "report_to names 'codecarbon' (CodeCarbonCallback requires `codecarbon` to be installed. "),
        (
            "no",
            "report_to=[False] holds False, which is not a tracker's name (YAML reads an unquoted no, off or false ",
        ),
        ("null", "report_to=[None] holds None, which is not a tracker's name"),
    ],
)
def test_every_report_to_transformers_refuses_is_one_line_before_loading(
    report_to, expected, tiny_model_path, problems_file, tmp_path, no_model_loading, capsys
):
    """Issue 53: a misspelt tracker, one opefo-train did not list, or a YAML `no` (read as false) ended in a raw
    ValueError once the model had loaded."""
    recipe = tmp_path / "tracked.yaml"
    recipe.write_text(f"base: {os.path.abspath(RECIPE)}\nreport_to: {report_to}\n")
    overrides = _cpu_overrides(tiny_model_path, problems_file, str(tmp_path / "out"))
    tracker_off = overrides.index("--report_to")
    assert main(["--config", str(recipe), *overrides[:tracker_off], *overrides[tracker_off + 2 :]]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"opefo-train: error: {expected}") and err.count("\n") == 1


# ----------------------------------------------------------------------------------------------------------------------
# Validation before model loading
# ----------------------------------------------------------------------------------------------------------------------


def test_missing_dataset_column_fails_before_model_loading(tiny_model_path, tmp_path, no_model_loading, capsys):
    data_file = tmp_path / "q.jsonl"
    data_file.write_text(
        "".join(json.dumps({"question": f"What is 1 + {i}?", "answer": str(i + 1)}) + "\n" for i in range(4))
    )
    argv = ["--config", RECIPE, *_cpu_overrides(tiny_model_path, str(data_file), str(tmp_path / "out"))]
    assert main(argv) == 2
    message = capsys.readouterr().err
    assert "opefo-train: error: The problem column 'prompt' is missing" in message
    assert "Available columns: question, answer" in message
    # Naming the right columns fixes it (and reaches model loading, which the fixture refuses).
    with pytest.raises(no_model_loading):
        main(argv + ["--dataset_name", "local", "--problem_column", "question", "--answer_column", "answer"])


def test_prompt_longer_than_context_fails_before_model_loading(
    tiny_model_path, problems_file, tmp_path, no_model_loading, capsys
):
    # The tiny model's max_position_embeddings is 1024: 1000 completion tokens leave too little room for any prompt.
    argv = ["--config", RECIPE, *_cpu_overrides(tiny_model_path, problems_file, str(tmp_path / "out"))]
    assert main(argv + ["--max_completion_length", "1000"]) == 2
    message = capsys.readouterr().err
    assert "16 of 16 prompts are longer than 24 tokens" in message
    assert "context of 1024 tokens (max_position_embeddings)" in message
    # An explicit context length is honoured the same way, and so is vLLM's max_model_length.
    assert main(argv + ["--context_length", "30"]) == 2
    assert "context of 30 tokens" in capsys.readouterr().err
    assert main(argv + ["--use_vllm", "true", "--vllm_max_model_length", "40", "--max_completion_length", "20"]) == 2
    assert "context of 40 tokens" in capsys.readouterr().err


def _cli_error(err: str) -> str:
    """opefo-train's one-line error: stderr from its ``opefo-train: error:`` line on, with no traceback anywhere. Only
    a progress bar of datasets may come before it (the first time a test process prepares the session's data file)."""
    start = err.find("opefo-train: error: ")
    assert start >= 0 and "Traceback" not in err, err
    assert all("\r" in line or not line.strip() for line in err[:start].split("\n")), err
    return err[start:]


@pytest.mark.parametrize(
    "extra, error, message",
    [
        (["--reward_funcs", "accuracy"], ValueError, "Unknown reward function 'accuracy'"),
        (["--reward_funcs", "no_such_module.reward"], ValueError, "Cannot import module 'no_such_module'"),
        (["--reward_weights", "1.0", "2.0"], ValueError, "reward_weights has 2 entries but reward_funcs has 1"),
        (["--prompt_template", "chatml"], ValueError, "Unknown prompt template 'chatml'"),
        (["--dataset_files", "/no/data.jsonl"], FileNotFoundError, "Data file '/no/data.jsonl' does not exist"),
        (["--resume_from_checkpoint", "true"], ValueError, "has no checkpoint-<step> folder"),
        (["--resume_from_checkpoint", "/no/such/checkpoint-5"], FileNotFoundError, "is not a directory"),
        (["--dataset_name", "my/hub-set"], ValueError, "set `problem_column` and `answer_column`"),
        # TRL's ScriptArguments keys that opefo-train does not model, and the name they replaced.
        (["--dataset_split", "train"], ValueError, "'dataset_split' (renamed: use 'dataset_train_split')"),
        (["--dataset_streaming", "true"], ValueError, "dataset_streaming=true: opefo-train reads the whole training"),
        (["--ignore_bias_buffers", "true"], ValueError, "ignore_bias_buffers=true is TRL's DDP fix for its DPO"),
        (["--eval_strategy", "steps"], ValueError, "eval_strategy='steps': opefo-train trains without an evaluation"),
        (["--reward_funcs", "get_soft_overlong_punishment"], ValueError, "for max_completion_length=1280, not 8"),
        # Values TRL accepts that would fail only after the model loaded (first generation or optimizer step).
        (["--learning_rate", "-1"], ValueError, "learning_rate=-1.0: the learning rate must be >= 0 (e.g. 1e-6)"),
        (["--max_completion_length", "0"], ValueError, "max_completion_length=0: completions need at least 1 token"),
        (["--temperature", "0"], ValueError, "temperature=0.0: GRPO samples completions and scores"),
        # D9: a ZeroDivisionError / "maxlen must be non-negative" traceback after loading
        (["--gradient_accumulation_steps", "0"], ValueError, "gradient_accumulation_steps=0: must be at least 1."),
        (["--gradient_accumulation_steps", "-1"], ValueError, "gradient_accumulation_steps=-1: must be at least 1."),
        (["--per_device_train_batch_size", "0"], ValueError, "per_device_train_batch_size=0: must be at least 1."),
        # Non-finite numbers: before, lr inf trained a non-finite model with exit 0, nan and temperature nan crashed.
        (["--learning_rate", "inf"], ValueError, "learning_rate=inf: must be a finite number"),
        (["--learning_rate", "nan"], ValueError, "learning_rate=nan: must be a finite number"),
        (["--temperature", "nan"], ValueError, "temperature=nan: must be a finite number"),
        (["--max_grad_norm", "inf"], ValueError, "max_grad_norm=inf: must be a finite number"),
        (["--use_peft", "true", "--lora_dropout", "nan"], ValueError, "lora_dropout=nan: options must be finite"),
        # A model path that does not exist (transformers would raise HFValidationError: "Repo id must be ...").
        (["--model_name_or_path", "./no/model"], FileNotFoundError, "Model path './no/model' does not exist"),
        (["--model_name_or_path", "no such/model"], ValueError, "'no such/model' is neither a local directory nor"),
    ],
)
def test_bad_options_fail_before_model_loading(
    extra, error, message, tiny_model_path, problems_file, tmp_path, no_model_loading, capsys, snapshot
):
    argv = ["--config", RECIPE, *_cpu_overrides(tiny_model_path, problems_file, str(tmp_path / "out")), *extra]
    with pytest.raises(error, match=re.escape(message)):
        parse_args(argv)
    before = snapshot(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in _cli_error(err)
    assert snapshot(tmp_path) == before


def test_a_model_folder_without_weights_is_named_before_loading(
    tiny_model_path, problems_file, tmp_path, no_model_loading, capsys
):
    weightless = tmp_path / "model"
    weightless.mkdir()
    shutil.copy(os.path.join(tiny_model_path, "config.json"), weightless)
    argv = ["--config", RECIPE, *_cpu_overrides(str(weightless), problems_file, str(tmp_path / "out"))]
    assert main(argv) == 2
    err = _cli_error(capsys.readouterr().err)
    assert f"{weightless} holds no weights (no *.safetensors, pytorch_model*.bin or shard index)" in err


def test_a_model_folder_without_tokenizer_files_is_named_before_loading(
    tiny_model_path, problems_file, tmp_path, no_model_loading, capsys
):
    """D8: what a kill -9 while moving the final model leaves (config and weights, no tokenizer) was an IndexError
    after the model loaded."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_path, model, ignore=shutil.ignore_patterns("tokenizer*", "vocab*", "merges*"))
    argv = ["--config", RECIPE, *_cpu_overrides(str(model), problems_file, str(tmp_path / "out"))]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"opefo-train: error: Model directory {model} has no tokenizer files (none of tokenizer.json")
    assert "Traceback" not in err


def test_a_malformed_line_in_the_training_data_is_named_before_loading(
    tiny_model_path, problems_file, tmp_path, no_model_loading, capsys
):
    """D11: a `datasets` traceback (a JSON parse error deep in its json builder)."""
    data = tmp_path / "problems.jsonl"
    lines = open(problems_file).readlines()
    data.write_text("".join(lines[:2]) + '{"prompt": "What is 1 + 1?", "solution": "2"\n' + "".join(lines[2:]))
    argv = ["--config", RECIPE, *_cpu_overrides(tiny_model_path, str(data), str(tmp_path / "out"))]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"opefo-train: error: Data file '{data}', line 3, is not a JSON object (Expecting ',' delimiter: column 45)"
    )
    assert "fix or remove that line" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_dangling_symlink_output_dir_and_a_duplicate_recipe_key_are_one_line(
    tiny_model_path, problems_file, tmp_path, no_model_loading, capsys
):
    """Issue 32: "[Errno 17] File exists" for the link; the last of two values taken without a word for the key."""
    link = tmp_path / "runs"
    link.symlink_to(tmp_path / "gone")
    argv = ["--config", RECIPE, *_cpu_overrides(tiny_model_path, problems_file, str(link))]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == (
        f"opefo-train: error: output_dir '{link}' is a symbolic link to '{tmp_path / 'gone'}', which does not exist; "
        "create that folder, or give another --output_dir.\n"
    )
    recipe = tmp_path / "twice.yaml"
    lines = RECIPE_TEXT.splitlines()
    recipe.write_text("\n".join([*lines, "learning_rate: 1.0e-5"]) + "\n")
    first = next(i for i, line in enumerate(lines, 1) if line.startswith("learning_rate:"))
    argv = ["--config", str(recipe), *_cpu_overrides(tiny_model_path, problems_file, str(tmp_path / "out"))]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == (
        f"opefo-train: error: Recipe file '{recipe}': key 'learning_rate' is given twice (lines {first} and "
        f"{len(lines) + 1}); keep one.\n"
    )


def test_resume_from_a_run_folder_is_not_a_checkpoint(
    tiny_model_path, problems_file, tmp_path, write_checkpoint, no_model_loading, capsys
):
    """Issue 32: "the save of this checkpoint did not finish" for a folder that is no checkpoint at all."""
    out = tmp_path / "out"
    write_checkpoint(out, 2)
    argv = ["--config", RECIPE, *_cpu_overrides(tiny_model_path, problems_file, str(tmp_path / "new"))]
    for folder in (out, tiny_model_path):
        assert main([*argv, "--resume_from_checkpoint", str(folder)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"opefo-train: error: resume_from_checkpoint {folder} is not a checkpoint")
    assert "it is a model: start from its weights with --model_name_or_path" in err


def test_missing_model_is_a_clear_error(problems_file, tmp_path):
    with pytest.raises(ValueError, match="model_name_or_path is not set"):
        parse_args(["--dataset_files", problems_file, "--use_cpu", "true", "--output_dir", str(tmp_path)])


# ----------------------------------------------------------------------------------------------------------------------
# Training through the entry point
# ----------------------------------------------------------------------------------------------------------------------


TRL_GRPO_RECIPE = """\
# The shape of a recipe for TRL's `trl grpo` (scripts/grpo.py): TRL's ScriptArguments keys and reward names.
model_name_or_path: {model}
dataset_name: {data}
dataset_config: null
dataset_train_split: validation
dataset_test_split: test
dataset_streaming: false
reward_funcs:
  - accuracy_reward
  - think_format_reward
  - opefo_cli_test_rewards.digit_overlap_reward
output_dir: {out}
max_completion_length: 8
num_generations: 2
per_device_train_batch_size: 4
gradient_accumulation_steps: 2
max_steps: 1
use_cpu: true
bf16: false
report_to: none
# opefo-train's own: the columns of a data set that is not one of its presets
problem_column: prompt
answer_column: solution
"""


def test_trls_script_argument_and_reward_names_train_on_the_split_they_name(
    tiny_model_path, write_jsonl, tmp_path, reward_module
):
    """A TRL-shaped recipe: the data set directory's `validation` split (dataset_train_split) is the one trained on,
    and TRL's reward functions are logged under their own names."""
    data = tmp_path / "arithmetic"
    data.mkdir()
    splits = {
        "train": [{"prompt": f"What is {i} + 1?", "solution": str(i + 1)} for i in range(8)],
        "validation": [{"prompt": f"What is {i} + 50?", "solution": str(i + 50)} for i in range(8)],
        "test": [{"prompt": f"What is {i} + 90?", "solution": str(i + 90)} for i in range(8)],
    }
    for split, rows in splits.items():
        write_jsonl(data / f"{split}.jsonl", rows)
    out = tmp_path / "out"
    recipe = tmp_path / "trl_grpo.yaml"
    recipe.write_text(TRL_GRPO_RECIPE.format(model=tiny_model_path, data=data, out=out))
    assert main(["--config", str(recipe)]) == 0
    assert reward_module.SEEN_SOLUTIONS and set(reward_module.SEEN_SOLUTIONS) <= {
        r["solution"] for r in splits["validation"]
    }
    (step,) = [m for m in _metrics(out) if "reward" in m]
    assert 0.0 <= step["rewards/accuracy_reward/mean"] <= 1.0 and step["rewards/think_format_reward/mean"] == 0.0
    total = sum(
        step[f"rewards/{name}/mean"] for name in ("accuracy_reward", "think_format_reward", "digit_overlap_reward")
    )
    assert step["reward"] == pytest.approx(total)


def test_trains_with_both_rewards_and_writes_metrics(tiny_model_path, problems_file, tmp_path, reward_module):
    out = str(tmp_path / "out")
    assert (
        main(
            [
                "--config",
                RECIPE,
                *_cpu_overrides(tiny_model_path, problems_file, out, max_steps=2),
                "--reward_funcs",
                "math_accuracy_reward",
                "opefo_cli_test_rewards.digit_overlap_reward",
            ]
        )
        == 0
    )
    steps = [m for m in _metrics(out) if "reward" in m]
    assert [m["step"] for m in steps] == [1, 2]
    gold = {str(i + 2 + 3 * i + 1) for i in range(16)}
    # Each step scores 4 prompts x 2 completions (4 per micro-batch x 2 accumulation steps), and the reward saw the
    # data set's gold answers, each once per completion of its prompt.
    assert len(reward_module.SEEN_SOLUTIONS) == 2 * 8 and set(reward_module.SEEN_SOLUTIONS) <= gold
    for m in steps:
        assert m["rewards/math_accuracy_reward/failures"] == 0
        assert 0.0 <= m["rewards/math_accuracy_reward/mean"] <= 1.0
        assert 0.0 <= m["rewards/digit_overlap_reward/mean"] <= 1.0
        total = m["rewards/math_accuracy_reward/mean"] + m["rewards/digit_overlap_reward/mean"]
        assert m["reward"] == pytest.approx(total)
        assert -1.0 < m["entropy_flow/lambda"] < 1.0
    # The final model is saved where the recipe's output_dir (overridden) says.
    for saved in ("model.safetensors", "tokenizer.json"):
        assert os.path.isfile(os.path.join(out, saved)), saved


def test_resume_restores_optimizer_and_method_state(tiny_model_path, problems_file, tmp_path, reward_module):
    """PAR's controller coefficient changes every step; a resumed run must continue from the saved value."""
    reward = ["--reward_funcs", "math_accuracy_reward", "opefo_cli_test_rewards.digit_overlap_reward"]
    first = str(tmp_path / "first")
    assert (
        main(
            [
                "--config",
                PAR_RECIPE,
                *_cpu_overrides(tiny_model_path, problems_file, first, max_steps=3, save_steps=1),
                *reward,
            ]
        )
        == 0
    )
    original = {m["step"]: m for m in _metrics(first) if "par/coef" in m}
    coefs = [original[s]["par/coef"] for s in (1, 2, 3)]
    assert coefs[0] < coefs[1] < coefs[2]  # the controller moved (tiny model entropy >> target)
    assert sorted(os.listdir(first)).count("checkpoint-2") == 1

    # Resume from checkpoint-2 by path into a fresh output_dir: step 3 is replayed exactly.
    resumed_dir = str(tmp_path / "resumed")
    assert (
        main(
            [
                "--config",
                PAR_RECIPE,
                *_cpu_overrides(tiny_model_path, problems_file, resumed_dir, max_steps=3),
                *reward,
                "--resume_from_checkpoint",
                os.path.join(first, "checkpoint-2"),
            ]
        )
        == 0
    )
    resumed = [m for m in _metrics(resumed_dir) if "par/coef" in m]
    assert [m["step"] for m in resumed] == [3]
    for key in ("par/coef", "entropy", "reward", "loss", "entropy_flow/net"):
        assert resumed[0][key] == pytest.approx(original[3][key], rel=1e-5, abs=1e-8), key

    # `--resume_from_checkpoint true` picks the last checkpoint of output_dir (checkpoint-3) and continues at step 4.
    assert (
        main(
            [
                "--config",
                PAR_RECIPE,
                *_cpu_overrides(tiny_model_path, problems_file, first, max_steps=4, save_steps=1),
                *reward,
                "--resume_from_checkpoint",
                "true",
            ]
        )
        == 0
    )
    continued = [m for m in _metrics(first) if "par/coef" in m and m["step"] == 4]
    assert len(continued) == 1
    assert continued[0]["par/coef"] == pytest.approx(min(1.0, coefs[2] + (coefs[2] - coefs[1])))
    with open(os.path.join(first, "checkpoint-4", METHOD_STATE_NAME)) as f:
        assert json.load(f)["method"] == "par"

    # Resuming an older checkpoint into the same output_dir replays step 4: metrics.jsonl keeps each step once.
    assert (
        main(
            [
                "--config",
                PAR_RECIPE,
                *_cpu_overrides(tiny_model_path, problems_file, first, max_steps=4, save_steps=1),
                *reward,
                "--resume_from_checkpoint",
                os.path.join(first, "checkpoint-3"),
            ]
        )
        == 0
    )
    assert [m["step"] for m in _metrics(first) if "par/coef" in m] == [1, 2, 3, 4]


GRPO_RECIPE = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "qwen2.5-math-7b", "grpo.yaml")


def test_a_resume_at_a_rollout_boundary_trains_what_the_uninterrupted_run_does_and_one_between_is_refused(
    tiny_model_path, problems_file, tmp_path, reward_module, monkeypatch, capsys, snapshot, caplog
):
    """H: two optimizer steps per rollout batch (steps_per_generation 2, gradient_accumulation_steps 1). A resume
    from step 3 of 4, between the two updates of the second rollout, sampled a new rollout and trained step 4 on
    other completions than the uninterrupted run (TRL's rollout buffer is not in the checkpoint), exit 0. Under a
    method whose token weights come from the rollout (kl_cov here) it is refused before loading, naming
    checkpoint-2, and so is a save_steps that would save such checkpoints; the resume from checkpoint-2 logs what
    the uninterrupted run logged and ends with its weights. Under method="grpo" it resumes, as GRPOTrainer does,
    saying what it loses (issue 53)."""
    import torch
    from safetensors.torch import load_file

    import opefo_trl.trainer

    off_policy = dict(gradient_accumulation_steps=1, steps_per_generation=2, save_steps=2, lr_scheduler_type="constant")
    reward = ["--reward_funcs", "opefo_cli_test_rewards.text_length_reward"]

    def argv(out, max_steps, *extra, method="kl_cov"):
        overrides = _cpu_overrides(tiny_model_path, problems_file, str(out), max_steps=max_steps, **off_policy)
        return ["--config", GRPO_RECIPE, *overrides, "--method", method, "--learning_rate", "1e-3", *reward, *extra]

    def _error_line(err):  # kl_cov's warnings come first
        assert "Traceback" not in err
        return err[err.index("opefo-train: error: ") :]

    schedule = (
        "TRL samples a rollout every 2 micro-batches (steps_per_generation 2 x num_iterations 1) and an optimizer step "
        "takes 1 (gradient_accumulation_steps), so a rollout spans 2 optimizer steps. TRL keeps the rollout in memory, "
        "not in the checkpoint"
    )
    whole, stopped, grpo = tmp_path / "whole", tmp_path / "stopped", tmp_path / "grpo"
    with monkeypatch.context() as refused_before_loading:
        refused_before_loading.setattr(opefo_trl.trainer, "OPEFOTrainer", lambda *a, **k: pytest.fail("loaded"))
        assert main(argv(whole, 4, "--save_steps", "3")) == 2
    assert _error_line(capsys.readouterr().err) == (
        f"opefo-train: error: save_steps=3 saves checkpoints between the updates of one rollout (at step 3): "
        f"{schedule}, and method='kl_cov' cannot resume from such a checkpoint (its token weights come from the "
        "rollout); give a save_steps that is a multiple of 2 (e.g. 4).\n"
    )
    assert main(argv(whole, 4)) == 0
    assert main(argv(stopped, 3)) == 0  # its final checkpoint, checkpoint-3, is between the updates of a rollout
    assert sorted(n for n in os.listdir(stopped) if n.startswith("checkpoint-")) == ["checkpoint-2", "checkpoint-3"]
    capsys.readouterr()

    before = snapshot(tmp_path)
    with monkeypatch.context() as refused_before_loading:
        refused_before_loading.setattr(opefo_trl.trainer, "OPEFOTrainer", lambda *a, **k: pytest.fail("loaded"))
        assert main(argv(stopped, 4, "--resume_from_checkpoint", "true")) == 2
    assert _error_line(capsys.readouterr().err) == (
        f"opefo-train: error: Cannot resume {stopped / 'checkpoint-3'}: it was saved at step 3, between the updates of "
        f"one rollout. {schedule}: the resume would sample a new rollout and train step 4 on other completions, with "
        f"other token weights, than the run's. Resume from {stopped / 'checkpoint-2'}, the latest checkpoint at a "
        f"rollout boundary, with --resume_from_checkpoint {stopped / 'checkpoint-2'}. To keep every checkpoint "
        "resumable, make save_steps (and max_steps) a multiple of 2.\n"
    )
    assert snapshot(tmp_path) == before

    assert main(argv(stopped, 4, "--resume_from_checkpoint", str(stopped / "checkpoint-2"))) == 0
    uninterrupted = {m["step"]: m for m in _metrics(str(whole)) if "loss" in m}
    resumed = {m["step"]: m for m in _metrics(str(stopped)) if "loss" in m}
    assert sorted(resumed) == sorted(uninterrupted) == [1, 2, 3, 4]
    assert uninterrupted[4]["loss"] != 0 and uninterrupted[4]["grad_norm"] > 0  # the rollout's second update trains
    for step in (3, 4):  # step 3 samples the rollout (its reward is logged), step 4 trains on it again
        for key in ("loss", "grad_norm", "entropy", *(("reward",) if step == 3 else ())):
            assert resumed[step][key] == pytest.approx(uninterrupted[step][key], rel=1e-5, abs=1e-8), (step, key)
    weights, expected = load_file(str(stopped / "model.safetensors")), load_file(str(whole / "model.safetensors"))
    for name, tensor in expected.items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=1e-7, msg=name)

    assert main(argv(grpo, 3, method="grpo")) == 0
    with caplog.at_level("WARNING", logger="opefo_trl.runs"):
        assert main(argv(grpo, 4, "--resume_from_checkpoint", "true", method="grpo")) == 0
    assert [m for m in caplog.messages if m.startswith("Resuming")] == [
        f"Resuming {grpo / 'checkpoint-3'}: it was saved at step 3, between the updates of one rollout. {schedule}, "
        "so, as GRPOTrainer does, the resume samples a new rollout and trains step 4 on other completions than the "
        "uninterrupted run would."
    ]
    assert [m["step"] for m in _metrics(str(grpo)) if "loss" in m] == [1, 2, 3, 4]


# ----------------------------------------------------------------------------------------------------------------------
# No run lost, no run mixed, every bad input refused before the weights load
# ----------------------------------------------------------------------------------------------------------------------


@pytest.fixture
def earlier_run(tmp_path, write_checkpoint):
    """An output_dir as a finished run of opefo-train leaves it (checkpoints, metrics, final weights, all in its
    manifest), with an opefo-eval folder and a hidden file that are not the run's."""
    from safetensors.torch import save_file

    out = tmp_path / "out"
    for step in (2, 3):
        write_checkpoint(out, step)
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 0.5}) + "\n" for s in (1, 2, 3)))
    save_file({"a": __import__("torch").zeros(4)}, str(out / "model.safetensors"))
    record_in_manifest(str(out), ["metrics.jsonl", "model.safetensors"])
    (out / "eval").mkdir()
    (out / "eval" / "samples.jsonl").write_text('{"kept": true}\n')
    (out / ".notes").write_text("mine")
    return out


def test_an_earlier_run_is_refused_unless_resumed_or_overwritten(
    earlier_run, tiny_model_path, problems_file, tmp_path, no_model_loading, capsys, snapshot
):
    argv = ["--config", RECIPE, *_cpu_overrides(tiny_model_path, problems_file, str(earlier_run))]
    before = snapshot(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert (
        f"opefo-train: error: output_dir '{earlier_run}' holds an earlier run (checkpoint-2, checkpoint-3, "
        "metrics.jsonl, model.safetensors); training into it would mix the two runs. Resume it with "
        "--resume_from_checkpoint true, start afresh in it with --overwrite_output_dir true"
    ) in err
    # Resuming another run's checkpoint into it would mix them too.
    other = tmp_path / "other"
    assert main(argv + ["--resume_from_checkpoint", str(other / "checkpoint-1")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    __import__("shutil").copytree(earlier_run / "checkpoint-2", other / "checkpoint-1")
    assert main(argv + ["--resume_from_checkpoint", str(other / "checkpoint-1")]) == 2
    assert "holds an earlier run" in capsys.readouterr().err
    __import__("shutil").rmtree(other)
    assert main(argv + ["--overwrite_output_dir", "true", "--resume_from_checkpoint", "true"]) == 2
    assert f"overwrite_output_dir would delete the checkpoint {earlier_run / 'checkpoint-3'}" in capsys.readouterr().err
    assert snapshot(tmp_path) == before
    # Resuming it, or overwriting it, passes the checks (and reaches model loading, which the fixture refuses).
    for accepted in (["--resume_from_checkpoint", "true", "--max_steps", "4"], ["--overwrite_output_dir", "true"]):
        with pytest.raises(no_model_loading):
            main(argv + accepted)
    assert snapshot(tmp_path) == before  # an overwrite that fails before its first checkpoint moves everything back


def test_overwrite_removes_the_earlier_run_and_nothing_else(
    earlier_run, tiny_model_path, problems_file, reward_module, snapshot
):
    kept = {k: v for k, v in snapshot(earlier_run).items() if k.startswith(("eval", ".notes"))}
    argv = [
        "--config",
        RECIPE,
        *_cpu_overrides(tiny_model_path, problems_file, str(earlier_run), save_steps=1),
        "--reward_funcs",
        "opefo_cli_test_rewards.digit_overlap_reward",
        "--overwrite_output_dir",
        "true",
    ]
    assert main(argv) == 0
    after = snapshot(earlier_run)
    assert sorted(name for name in os.listdir(earlier_run) if name.startswith("checkpoint-")) == ["checkpoint-1"]
    assert [m["step"] for m in _metrics(str(earlier_run))] == [1, 1]  # the new run's step 1 and its summary row
    assert {k: after[k] for k in kept} == kept  # the eval folder and the user's note are untouched
    # Nothing else is left: no set-aside folder, no lock; the manifest lists exactly what the new run wrote.
    listed = json.loads((earlier_run / MANIFEST_NAME).read_text())["entries"]
    assert sorted(os.listdir(earlier_run)) == sorted([*listed, MANIFEST_NAME, "eval", ".notes"])
    assert {"checkpoint-1", "metrics.jsonl", "model.safetensors", "config.json", "README.md"} <= set(listed)


FAILING_REWARD_MODULE = """
def string_reward(completions, **kwargs):
    return ["0.5" for _ in completions]


def nan_reward(completions, **kwargs):
    return [float("nan") if i % 2 else 1.0 for i in range(len(completions))]


def dict_reward(completions, **kwargs):
    return {"accuracy": 1.0, "format": 0.0}


def huge_reward(completions, **kwargs):
    return [1e300 if i % 2 else 0.0 for i in range(len(completions))]


def overflowing_reward(completions, **kwargs):
    return [10**400 if i % 2 else 0 for i in range(len(completions))]


def exiting_reward(completions, **kwargs):
    import sys

    sys.exit(3)
"""


@pytest.fixture
def failing_rewards(tmp_path, monkeypatch):
    (tmp_path / "opefo_cli_failing_rewards.py").write_text(FAILING_REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "opefo_cli_failing_rewards"
    __import__("sys").modules.pop("opefo_cli_failing_rewards", None)


def test_an_overwrite_that_fails_before_its_first_checkpoint_leaves_the_earlier_run_as_it_was(
    earlier_run, tiny_model_path, problems_file, failing_rewards, tmp_path, capsys, snapshot
):
    """The earlier run is set aside, not deleted, until the new run has saved something; a failure puts it back."""
    before = snapshot(tmp_path)
    argv = [
        "--config",
        RECIPE,
        *_cpu_overrides(tiny_model_path, problems_file, str(earlier_run), save_steps=1),
        "--reward_funcs",
        f"{failing_rewards}.string_reward",
        "--overwrite_output_dir",
        "true",
    ]
    assert main(argv) == 2
    assert "opefo-train: error: Reward function 'string_reward' returned '0.5'" in capsys.readouterr().err
    assert snapshot(tmp_path) == before


def test_the_models_own_folder_and_files_no_run_wrote_are_refused_before_loading(
    tiny_model_path, problems_file, tmp_path, no_model_loading, capsys, snapshot
):
    """An overwrite may not delete the model's own weights (--output_dir equal to the model's folder), nor a user
    folder's checkpoint-7/, metrics.jsonl or model.safetensors that no run wrote."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_path, model)
    before = snapshot(tmp_path)
    for overwrite in ([], ["--overwrite_output_dir", "true"]):
        argv = ["--config", RECIPE, *_cpu_overrides(str(model), problems_file, str(model)), *overwrite]
        assert main(argv) == 2
        assert (
            f"opefo-train: error: output_dir '{model}' is the folder of the model this run starts from "
            "(model_name_or_path): its checkpoints and final model would be written over the model's own files."
        ) in capsys.readouterr().err
    mine = tmp_path / "mine"
    (mine / "checkpoint-7").mkdir(parents=True)
    (mine / "checkpoint-7" / "paper.tex").write_text("\\documentclass{article}")
    (mine / "metrics.jsonl").write_text('{"step": 1, "mine": true}\n')
    (mine / "model.safetensors").write_bytes(b"my weights")
    before = snapshot(tmp_path)
    for overwrite in ([], ["--overwrite_output_dir", "true"]):
        assert main(["--config", RECIPE, *_cpu_overrides(tiny_model_path, problems_file, str(mine)), *overwrite]) == 2
        err = capsys.readouterr().err
        assert (
            f"opefo-train: error: output_dir '{mine}' holds files that no run of opefo-train wrote (its "
            "opefo_run_manifest.json does not list them): checkpoint-7, metrics.jsonl, model.safetensors. "
            "opefo-train writes over and deletes only what its own runs wrote: move them out of the folder, or give "
            "another --output_dir."
        ) in err
    assert snapshot(tmp_path) == before


def test_an_overwrite_that_would_delete_the_model_it_starts_from_is_refused(
    earlier_run, tiny_model_path, problems_file, no_model_loading, capsys, snapshot
):
    import shutil

    shutil.rmtree(earlier_run / "checkpoint-3")
    shutil.copytree(tiny_model_path, earlier_run / "checkpoint-3")  # a model saved by the earlier run
    before = snapshot(earlier_run)
    argv = ["--config", RECIPE, *_cpu_overrides(str(earlier_run / "checkpoint-3"), problems_file, str(earlier_run))]
    assert main(argv + ["--overwrite_output_dir", "true"]) == 2
    assert (
        f"overwrite_output_dir would delete {earlier_run / 'checkpoint-3'}, which holds "
        f"{earlier_run / 'checkpoint-3'}, the model this run starts from"
    ) in capsys.readouterr().err
    assert snapshot(earlier_run) == before


@pytest.mark.parametrize(
    "name, damage, reason",
    [
        ("model.safetensors", "truncate", "is cut short: it has"),
        ("model.safetensors", "empty", "is empty"),
        ("optimizer.pt", "truncate", "is cut short: it has"),
        ("trainer_state.json", "truncate", "is cut short: it has"),
        ("opefo_method_state.json", "empty", "is empty"),
        (CHECKPOINT_MARKER, "remove", "is missing: the save of this checkpoint did not finish"),
    ],
)
def test_a_broken_checkpoint_is_named_before_loading_with_the_one_to_try(
    earlier_run, name, damage, reason, tiny_model_path, problems_file, tmp_path, no_model_loading, capsys, snapshot
):
    path = earlier_run / "checkpoint-3" / name
    if damage == "remove":
        os.remove(path)
    else:
        with open(path, "r+b") as f:
            f.truncate(0 if damage == "empty" else os.path.getsize(path) // 2)
    argv = ["--config", RECIPE, *_cpu_overrides(tiny_model_path, problems_file, str(earlier_run))]
    before = snapshot(tmp_path)
    assert main(argv + ["--resume_from_checkpoint", str(earlier_run / "checkpoint-3")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"opefo-train: error: Cannot resume from {earlier_run / 'checkpoint-3'}: {path} {reason}")
    assert f"Resume from the previous checkpoint with --resume_from_checkpoint {earlier_run / 'checkpoint-2'}." in err
    assert "Traceback" not in err and snapshot(tmp_path) == before
    # The named fix passes the checks, and so does `true`, which takes the last whole checkpoint: checkpoint-2.
    for resume in (str(earlier_run / "checkpoint-2"), "true"):
        with pytest.raises(no_model_loading):
            main(argv + ["--resume_from_checkpoint", resume, "--max_steps", "4"])
    assert snapshot(tmp_path) == before


def test_a_checkpoint_of_another_method_is_refused_before_loading(
    tmp_path, write_checkpoint, tiny_model_path, problems_file, no_model_loading, capsys, snapshot
):
    checkpoint = write_checkpoint(tmp_path / "out", 4, method="par")
    argv = ["--config", RECIPE, *_cpu_overrides(tiny_model_path, problems_file, str(tmp_path / "out"))]
    before = snapshot(tmp_path)
    assert main(argv + ["--resume_from_checkpoint", "true"]) == 2
    err = capsys.readouterr().err
    assert (
        f"Checkpoint {checkpoint} was trained with method='par', but this run uses method='opefo'. Resume with "
        "--method par"
    ) in err
    assert snapshot(tmp_path) == before


def test_an_output_dir_that_is_a_file_and_an_empty_data_file(
    tiny_model_path, problems_file, tmp_path, no_model_loading, capsys, snapshot
):
    (tmp_path / "out").write_text("not a folder")
    (tmp_path / "empty.jsonl").write_text("")
    before = snapshot(tmp_path)
    assert main(["--config", RECIPE, *_cpu_overrides(tiny_model_path, problems_file, str(tmp_path / "out"))]) == 2
    assert f"output_dir '{tmp_path / 'out'}' is a file; give a directory" in capsys.readouterr().err
    argv = ["--config", RECIPE, *_cpu_overrides(tiny_model_path, str(tmp_path / "empty.jsonl"), str(tmp_path / "o"))]
    assert main(argv) == 2
    assert f"Data file '{tmp_path / 'empty.jsonl'}' is empty" in capsys.readouterr().err
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    "line, message",
    [
        ("max_steps: 2.5", "`max_steps: 2.5` is a float, but max_steps takes an integer."),
        (
            "num_generations: [2]",
            "`num_generations: [2]` is a list, but num_generations takes an integer or null (e.g. ",
        ),
    ],
)
def test_recipe_values_of_the_wrong_type_are_refused(line, message, tiny_model_path, problems_file, tmp_path, capsys):
    recipe = tmp_path / "typed.yaml"
    key = line.split(":")[0]
    kept = [entry for entry in RECIPE_TEXT.splitlines() if not entry.startswith(f"{key}:")]
    recipe.write_text("\n".join([*kept, line]) + "\n")
    overrides = [a for a in _cpu_overrides(tiny_model_path, problems_file, str(tmp_path / "out")) if a]
    i = overrides.index(f"--{key}")
    argv = ["--config", str(recipe), *overrides[:i], *overrides[i + 2 :]]  # the recipe's value, not the flag's
    assert main(argv) == 2
    assert f"opefo-train: error: Recipe '{recipe}': {message}" in capsys.readouterr().err


def test_an_unknown_key_is_reported_before_a_setting_this_machine_lacks(tmp_path, capsys):
    """The GPU recipe (bf16) parsed on a CPU machine: the typo is what needs fixing first."""
    recipe = tmp_path / "typo.yaml"
    recipe.write_text(RECIPE_TEXT + "\nnum_generation: 4\n")
    assert main(["--config", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "Unknown key(s) in recipe" in err and "'num_generation' (did you mean 'num_generations'" in err


def test_a_reward_returning_strings_stops_at_its_first_call_without_a_traceback(
    tiny_model_path, problems_file, tmp_path, failing_rewards, capsys
):
    out = tmp_path / "out"
    argv = [
        "--config",
        RECIPE,
        *_cpu_overrides(tiny_model_path, problems_file, str(out), save_steps=1),
        "--reward_funcs",
        f"{failing_rewards}.string_reward",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert (
        "opefo-train: error: Reward function 'string_reward' returned '0.5' (a str) for completion 0 of 8 (8 such "
        "value(s) in this batch); rewards must be numbers"
    ) in err
    assert "Traceback" not in err
    assert not os.path.exists(out)  # no step, no checkpoint, no metrics line, no lock or manifest


@pytest.mark.parametrize(
    "reward, message",
    [
        # half NaN: would train at loss 0, grad-norm 0
        ("nan_reward", "returned nan for 4 of 8 completions (first: completion 1); a non-finite reward"),
        ("dict_reward", "returned {'accuracy': 1.0, 'format': 0.0} (a dict); it must return a list"),
        # D12: reward_std inf (loss 0, nothing trained, exit 0), and an OverflowError traceback
        ("huge_reward", "returned 1e+300 for 4 of 8 completions (first: completion 1); TRL holds rewards in float32"),
        ("overflowing_reward", "returned an integer of 401 digits for 4 of 8 completions (first: completion 1)"),
        # D14: exit 3 with no message
        ("exiting_reward", "raised SystemExit: 3 at "),
    ],
)
def test_a_reward_returning_nan_or_a_dict_stops_at_its_first_call(
    reward, message, tiny_model_path, problems_file, tmp_path, failing_rewards, capsys
):
    argv = [
        "--config",
        RECIPE,
        *_cpu_overrides(tiny_model_path, problems_file, str(tmp_path / "out")),
        "--reward_funcs",
        f"{failing_rewards}.{reward}",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"opefo-train: error: Reward function '{reward}' {message}" in err
    assert "Traceback" not in err


def _prompt_order(log):
    steps = {}
    with open(log) as f:
        for line in f:
            record = json.loads(line)
            steps.setdefault(record["step"], []).append(record["solutions"])
    return steps


ORDER_MODULE = '''
import json, os


def order_reward(completions, solution, trainer_state, **kwargs):
    """Records which prompts each step scores (in order), and a reward that varies within a group."""
    with open(os.environ["OPEFO_ORDER_LOG"], "a") as f:
        f.write(json.dumps({"step": trainer_state.global_step, "solutions": solution}) + "\\n")
    return [float(len(c[-1]["content"]) % 3) for c in completions]
'''


def test_resume_draws_the_prompts_of_an_uninterrupted_run_in_every_epoch(
    tiny_model_path, problems_file, tmp_path, monkeypatch
):
    """8 problems, 4 per step: epochs of 2 steps. Resumed at an epoch boundary (checkpoint-2) and within the second
    epoch (checkpoint-3), every later step scores the prompts, in the order, and with the metrics, of the
    uninterrupted run. (With TRL's RepeatSampler alone, measured with this seed: resumed at checkpoint-2, epoch 2
    replays epoch 1's order; resumed at checkpoint-3, epoch 2 scores 2 of the 8 prompts twice and 2 never.)"""
    (tmp_path / "opefo_cli_order_rewards.py").write_text(ORDER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    settings = dict(max_steps=-1, num_train_epochs=2, save_steps=1, save_total_limit=10, max_train_samples=8)
    reward = ["--reward_funcs", "opefo_cli_order_rewards.order_reward"]

    def run(name, *extra):
        monkeypatch.setenv("OPEFO_ORDER_LOG", str(tmp_path / f"{name}.log"))
        out = str(tmp_path / name)
        assert (
            main(
                ["--config", RECIPE, *_cpu_overrides(tiny_model_path, problems_file, out, **settings), *reward, *extra]
            )
            == 0
        )
        return _prompt_order(tmp_path / f"{name}.log"), {m["step"]: m for m in _metrics(out) if "entropy" in m}

    full_order, full_metrics = run("full")
    assert sorted(full_order) == [0, 1, 2, 3] and full_order[0] + full_order[1] != full_order[2] + full_order[3]
    for checkpoint in (2, 3):
        order, metrics = run(
            f"from{checkpoint}", "--resume_from_checkpoint", str(tmp_path / "full" / f"checkpoint-{checkpoint}")
        )
        assert order == {step: full_order[step] for step in range(checkpoint, 4)}
        for step, logged in metrics.items():
            for key in ("entropy", "reward", "loss"):
                assert logged[key] == pytest.approx(full_metrics[step][key], rel=1e-6, abs=1e-9), (checkpoint, step)


# ----------------------------------------------------------------------------------------------------------------------
# Two processes on one folder, and what a kill leaves
# ----------------------------------------------------------------------------------------------------------------------

BLOCKING_MODULE = '''
import os, time


def blocking_reward(completions, **kwargs):
    """Says it is running, then waits (holding its run's folder) until the test lets it go."""
    open(os.environ["OPEFO_READY"], "w").close()
    deadline = time.time() + 300
    while not os.path.exists(os.environ["OPEFO_GO"]) and time.time() < deadline:
        time.sleep(0.1)
    return [float(len(c[-1]["content"]) % 3) for c in completions]
'''

KILLED_SAVE = """
import os, signal, sys

import opefo_trl.runs.checkpoint as runs  # where saving_checkpoint looks it up

original = runs.save_method_state


def killed_before_the_method_state(folder, method, state):
    if folder.endswith("checkpoint-3"):  # every Trainer file of checkpoint-3 is written: kill -9 here
        os.kill(os.getpid(), signal.SIGKILL)
    original(folder, method, state)


runs.save_method_state = killed_before_the_method_state
from opefo_trl.cli.train import main

sys.exit(main(sys.argv[1:]))
"""


def _start(tmp_path, argv, script=None, **env):
    import subprocess
    import sys

    command = [sys.executable, "-c", script] if script else [sys.executable, "-m", "opefo_trl.cli.train"]
    # The checkout under test first: the package's installed copy may be another checkout's.
    python_path = os.pathsep.join([env.pop("PYTHONPATH", str(tmp_path)), str(Path(__file__).parents[2])])
    environment = {**os.environ, "PYTHONPATH": python_path, "HF_HUB_OFFLINE": "1", **env}
    return subprocess.Popen([*command, *argv], env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_a_second_run_into_the_folder_is_refused_at_once_and_a_killed_run_blocks_nothing(
    tiny_model_path, problems_file, tmp_path, monkeypatch, capsys
):
    """Two runs writing into one folder would mix their metrics and checkpoints: the second is refused."""
    import signal
    import time

    (tmp_path / "opefo_cli_blocking_rewards.py").write_text(BLOCKING_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "out"
    argv = [
        "--config",
        RECIPE,
        *_cpu_overrides(tiny_model_path, problems_file, str(out), max_steps=2),
        "--reward_funcs",
        "opefo_cli_blocking_rewards.blocking_reward",
    ]
    ready, go = tmp_path / "ready", tmp_path / "go"
    first = _start(tmp_path, argv, OPEFO_READY=str(ready), OPEFO_GO=str(go))
    try:
        deadline = time.time() + 300
        while not ready.exists() and first.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert ready.exists(), first.communicate()[0].decode()[-3000:]
        assert main(argv) == 2  # this process, while the first one trains
        err = capsys.readouterr().err
        assert (
            f"opefo-train: error: output_dir '{out}' is in use by another run: pid {first.pid} on host "
            f"{__import__('socket').gethostname()} (since "
        ) in err
        assert f"holds its lock {out / LOCK_NAME}." in err and "Traceback" not in err
        first.send_signal(signal.SIGKILL)
        first.wait()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert (out / LOCK_NAME).exists()  # left by the killed run; the kernel released its lock
    go.touch()
    monkeypatch.setenv("OPEFO_READY", str(ready))
    monkeypatch.setenv("OPEFO_GO", str(go))
    assert main(argv) == 0  # the killed run wrote nothing of its own: nothing to resume or overwrite
    __import__("sys").modules.pop("opefo_cli_blocking_rewards", None)
    steps = [m["step"] for m in _metrics(str(out)) if "reward" in m]
    assert steps == [1, 2]  # one run's rows, once each
    assert not (out / LOCK_NAME).exists()


def test_an_overwrite_killed_before_its_first_save_is_undone_by_the_next_run(
    earlier_run, tiny_model_path, problems_file, tmp_path, monkeypatch, capsys, snapshot
):
    """kill -9 of an overwrite while it trains (the earlier run set aside, nothing of the new run saved): the next
    opefo-train moves the earlier run back, byte for byte, before anything else."""
    import time

    (tmp_path / "opefo_cli_blocking_rewards.py").write_text(BLOCKING_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    before = snapshot(earlier_run)
    argv = [
        "--config", RECIPE, *_cpu_overrides(tiny_model_path, problems_file, str(earlier_run), max_steps=2),
        "--reward_funcs", "opefo_cli_blocking_rewards.blocking_reward",
    ]  # fmt: skip
    ready = tmp_path / "ready"
    overwrite = _start(tmp_path, [*argv, "--overwrite_output_dir", "true"], OPEFO_READY=str(ready), OPEFO_GO="/no")
    try:
        deadline = time.time() + 300
        while not ready.exists() and overwrite.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert ready.exists(), overwrite.communicate()[0].decode()[-3000:]
        assert not (earlier_run / "checkpoint-2").exists()  # set aside while the new run trains
    finally:
        overwrite.kill()
        overwrite.wait()
    assert main(argv) == 2  # the next run: the earlier one is back, and refused as an earlier run
    assert f"output_dir '{earlier_run}' holds an earlier run" in capsys.readouterr().err
    after = snapshot(earlier_run)
    assert {k: v for k, v in after.items() if k != LOCK_NAME} == before  # the killed run's lock file stays


def test_an_overwrite_whose_first_save_is_its_final_model_keeps_the_earlier_run_until_then(
    earlier_run, tiny_model_path, problems_file, reward_module, monkeypatch, capsys
):
    """No checkpoint (save_strategy no): the earlier run stays set aside through training and is deleted
    once the final model has landed; if the final model cannot be written, the earlier run is moved back."""
    import errno

    from opefo_trl.runs import FINAL_MODEL_STAGING, read_manifest

    argv = [
        "--config", RECIPE, *_cpu_overrides(tiny_model_path, problems_file, str(earlier_run), save_strategy="no"),
        "--reward_funcs", "opefo_cli_test_rewards.digit_overlap_reward", "--overwrite_output_dir", "true",
    ]  # fmt: skip
    earlier = sorted(os.listdir(earlier_run))
    from transformers import Trainer

    real_save_model = Trainer.save_model

    def full_disk(self, output_dir=None, _internal_call=False):
        assert (earlier_run / ".opefo_overwritten" / "checkpoint-2").exists()  # still set aside, not deleted
        raise OSError(errno.ENOSPC, "No space left on device", output_dir)

    monkeypatch.setattr(Trainer, "save_model", full_disk)
    assert main(argv) == 2
    staging = earlier_run / FINAL_MODEL_STAGING
    assert f"opefo-train: error: Cannot save the final model {staging}: OSError: [Errno 28]" in capsys.readouterr().err
    assert sorted(os.listdir(earlier_run)) == earlier  # moved back
    monkeypatch.setattr(Trainer, "save_model", real_save_model)
    assert main(argv) == 0
    assert not (earlier_run / "checkpoint-2").exists() and not (earlier_run / ".opefo_overwritten").exists()
    assert (earlier_run / "eval" / "samples.jsonl").exists()  # not the run's: kept
    assert "model.safetensors" in read_manifest(str(earlier_run))


def test_a_run_killed_between_the_trainers_files_and_the_method_state_resumes_the_last_whole_checkpoint(
    tiny_model_path, problems_file, tmp_path, reward_module, caplog, capsys
):
    """A checkpoint without opefo_method_state.json is not whole: resuming from it would restart PAR's coefficient
    (par/coef 0.0 at step 4 instead of continuing)."""
    out = tmp_path / "out"
    reward = ["--reward_funcs", "opefo_cli_test_rewards.digit_overlap_reward"]
    argv = ["--config", PAR_RECIPE, *_cpu_overrides(tiny_model_path, problems_file, str(out), max_steps=4), *reward]
    killed = _start(tmp_path / "..", [*argv, "--save_steps", "1"], KILLED_SAVE, PYTHONPATH=str(tmp_path))
    output = killed.communicate(timeout=600)[0].decode()
    assert killed.returncode == -9, output[-3000:]
    checkpoint = out / "checkpoint-3"
    assert (checkpoint / "optimizer.pt").exists() and not (checkpoint / METHOD_STATE_NAME).exists()
    logged = {m["step"]: m for m in _metrics(str(out)) if "par/coef" in m}
    assert sorted(logged) == [1, 2, 3]
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "par/co')  # and a line cut off by a kill while it was written

    # Named, with the checkpoint to use instead:
    assert main([*argv, "--resume_from_checkpoint", str(checkpoint)]) == 2
    assert (
        f"opefo-train: error: Cannot resume from {checkpoint}: {checkpoint / CHECKPOINT_MARKER} is missing: the save "
        "of this checkpoint did not finish (opefo-train writes it last, once every other file is saved). Resume from "
        f"the previous checkpoint with --resume_from_checkpoint {out / 'checkpoint-2'}."
    ) in capsys.readouterr().err
    # `true` takes checkpoint-2, says why, replays step 3 as the killed run logged it, and continues PAR's controller.
    with caplog.at_level("WARNING"):
        assert main([*argv, "--save_steps", "1", "--resume_from_checkpoint", "true"]) == 0
    assert f"Skipping {checkpoint}: {checkpoint / CHECKPOINT_MARKER} is missing" in caplog.text
    assert f"{out / 'metrics.jsonl'}: dropped its last line, cut off" in caplog.text
    resumed = {m["step"]: m for m in _metrics(str(out)) if "par/coef" in m}
    assert sorted(resumed) == [1, 2, 3, 4]
    assert resumed[3]["par/coef"] == pytest.approx(logged[3]["par/coef"]) and resumed[3]["par/coef"] > 0
    coefs = [resumed[s]["par/coef"] for s in (2, 3, 4)]
    assert coefs[2] == pytest.approx(min(1.0, coefs[1] + (coefs[1] - coefs[0])))
    __import__("opefo_trl.runs").runs.check_checkpoint(str(checkpoint), "par")  # saved again, whole


def test_a_corrupt_metrics_line_is_refused_before_loading(
    earlier_run, tiny_model_path, problems_file, no_model_loading, capsys, snapshot
):
    """Refused before loading, not a JSONDecodeError traceback from the metrics callback after it."""
    (earlier_run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')
    before = snapshot(earlier_run)
    argv = ["--config", RECIPE, *_cpu_overrides(tiny_model_path, problems_file, str(earlier_run))]
    assert main(argv + ["--resume_from_checkpoint", "true"]) == 2
    err = capsys.readouterr().err
    assert f"opefo-train: error: {earlier_run / 'metrics.jsonl'}, line 2, is not a metrics record" in err
    assert "fix or delete that line" in err and snapshot(earlier_run) == before


def test_a_full_disk_during_a_checkpoint_is_one_line_and_leaves_no_partial_checkpoint(
    earlier_run, tiny_model_path, problems_file, reward_module, tmp_path, monkeypatch, capsys, snapshot
):
    """One line, not torch's inline_container traceback, and no partial optimizer.pt left. Here into an overwritten
    run: it is moved back, since the new run saved nothing."""
    import errno

    import torch

    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        if str(f).endswith("optimizer.pt"):
            with open(f, "wb") as partial:
                partial.write(b"PK\x03\x04")
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    before = snapshot(tmp_path)
    argv = [
        "--config",
        RECIPE,
        *_cpu_overrides(tiny_model_path, problems_file, str(earlier_run), save_steps=1),
        "--reward_funcs",
        "opefo_cli_test_rewards.digit_overlap_reward",
        "--overwrite_output_dir",
        "true",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    checkpoint = earlier_run / "checkpoint-1"
    assert [line for line in err.splitlines() if "error" in line.lower()] == [
        f"opefo-train: error: Cannot save the checkpoint {checkpoint}: OSError: [Errno 28] No space left on device: "
        f"'{checkpoint / 'optimizer.pt'}'. The unfinished checkpoint was removed. Free space on that disk (or make the "
        "folder writable), then run the command again (no whole checkpoint of this run is left to resume from)."
    ]
    assert "Traceback" not in err
    assert snapshot(tmp_path) == before


@pytest.fixture
def small_disk(tmp_path):
    """A 640 KiB tmpfs (the tiny model's weights are 373 KiB, its optimizer state twice that): a real full disk.
    Mounting needs root; skipped elsewhere."""
    import subprocess

    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=640k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


def test_a_really_full_disk_during_a_checkpoint_is_one_line_and_leaves_no_partial_checkpoint(
    small_disk, tiny_model_path, problems_file, reward_module, capsys
):
    """torch's own error for a full disk (a RuntimeError from its zip writer, not an OSError) on a real tmpfs: one
    line naming the checkpoint, and no partial checkpoint left to be picked up."""
    out = small_disk / "out"
    argv = [
        "--config", RECIPE, *_cpu_overrides(tiny_model_path, problems_file, str(out), save_steps=1),
        "--reward_funcs", "opefo_cli_test_rewards.digit_overlap_reward",
    ]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("opefo-train: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].startswith(f"opefo-train: error: Cannot save the checkpoint {out / 'checkpoint-1'}: the disk is ")
    assert "The unfinished checkpoint was removed. Free space on that disk" in errors[0]
    assert not (out / "checkpoint-1").exists()
    from opefo_trl.runs import read_manifest

    assert set(os.listdir(out)) - {MANIFEST_NAME} <= set(read_manifest(str(out)))  # what remains is the run's own


def test_the_command_a_full_disk_at_a_fresh_runs_first_checkpoint_names_works_once_there_is_space(
    small_disk, tiny_model_path, problems_file, reward_module, capsys
):
    """W: the message said "run the command again"; that rerun was refused ("holds an earlier run ... resume it"), and
    the resume failed ("no checkpoint-<step> folder"). The command the message names now trains, once the disk has
    room (the tmpfs remounted larger)."""
    import re
    import subprocess

    out = small_disk / "out"
    argv = [
        "--config", RECIPE, *_cpu_overrides(tiny_model_path, problems_file, str(out), save_steps=1),
        "--reward_funcs", "opefo_cli_test_rewards.digit_overlap_reward",
    ]  # fmt: skip
    assert main(argv) == 2
    (error,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("opefo-train: error:")]
    then = error.split("Free space on that disk (or make the folder writable), then ", 1)[1]
    subprocess.run(["mount", "-o", "remount,size=8m", str(small_disk)], check=True)
    named = re.findall(r"(--\w+) (\S+?)\b", then.split(" (", 1)[0])  # the options the command is run again with
    assert main([*argv, *(part for option in named for part in option)]) == 0, capsys.readouterr().err
    assert then == (
        "run the command again with --overwrite_output_dir true (no whole checkpoint of this run is left to resume "
        f"from; the overwrite replaces the README.md, metrics.jsonl it left in {out})."
    )
    assert (out / "checkpoint-1").is_dir() and (out / "model.safetensors").is_file()
    assert [m["step"] for m in _metrics(str(out)) if "reward" in m] == [1]  # the failed run's line replaced


def test_probe_prompts_are_set_aside_from_training_and_sampled_as_the_fixed_probe(
    tiny_model_path, problems_file, tmp_path, reward_module
):
    """--probe_prompts 4: the data file's last 4 problems are never trained on (the reward never sees their answers
    in 3 steps that draw each of the other 12 once), and the `param` flow measures their completions."""
    out = str(tmp_path / "out")
    argv = [
        "--config", RECIPE, *_cpu_overrides(tiny_model_path, problems_file, out, max_steps=3),
        "--reward_funcs", "opefo_cli_test_rewards.digit_overlap_reward",
        "--entropy_flow_estimate", "param", "--probe_prompts", "4",
    ]  # fmt: skip
    assert main(argv) == 0
    gold = [str(i + 2 + 3 * i + 1) for i in range(16)]
    assert set(reward_module.SEEN_SOLUTIONS) == set(gold[:12])
    assert all(-1.0 < m["entropy_flow/lambda"] < 1.0 for m in _metrics(out) if "entropy_flow/lambda" in m)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--probe_prompts", "2"], "probe_dataset sets the entropy the 'param' estimate measures"),
        (["--probe_prompts", "16", "--entropy_flow_estimate", "param"], "would set aside every one of the 16"),
        (["--probe_prompts", "-1"], "probe_prompts must be >= 0"),
    ],
)
def test_a_probe_without_effect_or_data_is_refused_before_loading(
    extra, message, tiny_model_path, problems_file, tmp_path, no_model_loading, capsys
):
    argv = ["--config", RECIPE, *_cpu_overrides(tiny_model_path, problems_file, str(tmp_path / "out")), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in _cli_error(err)


# ----------------------------------------------------------------------------------------------------------------------
# Issue 32: nothing deleted that the run did not write, no resume that silently changes the run, one line per mistake
# ----------------------------------------------------------------------------------------------------------------------

NEIGHBOUR_MODULE = '''
import json, os


def writes_beside_the_run(completions, **kwargs):
    """While the run trains, files appear in its output_dir that it did not write: an opefo-eval store, a user's
    notes, a folder."""
    out = os.environ["OPEFO_RUN_DIR"]
    if not os.path.exists(os.path.join(out, "eval_ck1")):
        os.makedirs(os.path.join(out, "eval_ck1"))
        with open(os.path.join(out, "eval_ck1", "samples.jsonl"), "w") as f:
            f.write(json.dumps({"sample": 1}) + "\\n")
        with open(os.path.join(out, "eval_ck1", "run_config.json"), "w") as f:
            json.dump({"temperature": 1.0}, f)
        with open(os.path.join(out, "notes.txt"), "w") as f:
            f.write("mine")
        os.makedirs(os.path.join(out, "my_folder"))
        with open(os.path.join(out, "my_folder", "data.txt"), "w") as f:
            f.write("mine too")
    return [float(len(c[-1]["content"]) % 3) for c in completions]
'''


def test_files_that_appear_beside_a_run_are_not_its_own_and_an_overwrite_keeps_them(
    tiny_model_path, problems_file, tmp_path, monkeypatch, capsys, snapshot
):
    """D1: the manifest lists what the run wrote, never what appeared in its folder while it ran; an overwrite is
    refused while the user's files are there (naming them), and once they are moved out deletes the run's files only:
    the opefo-eval store written meanwhile is kept."""
    (tmp_path / "opefo_cli_neighbour_rewards.py").write_text(NEIGHBOUR_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "out"
    monkeypatch.setenv("OPEFO_RUN_DIR", str(out))
    argv = [
        "--config", RECIPE, *_cpu_overrides(tiny_model_path, problems_file, str(out), max_steps=2, save_steps=1),
        "--reward_funcs", "opefo_cli_neighbour_rewards.writes_beside_the_run",
    ]  # fmt: skip
    assert main(argv) == 0
    __import__("sys").modules.pop("opefo_cli_neighbour_rewards", None)
    listed = json.loads((out / MANIFEST_NAME).read_text())["entries"]
    assert {"checkpoint-1", "checkpoint-2", "metrics.jsonl", "model.safetensors"} <= set(listed)
    assert not {"notes.txt", "my_folder", "eval_ck1"} & set(listed)
    kept = {k: v for k, v in snapshot(out).items() if k.startswith(("notes.txt", "my_folder", "eval_ck1"))}
    assert len(kept) == 4

    overwrite = [*argv, "--overwrite_output_dir", "true"]
    before = snapshot(tmp_path)
    assert main(overwrite) == 2
    err = capsys.readouterr().err
    assert f"output_dir '{out}' holds files that no run of opefo-train wrote" in err
    assert "my_folder, notes.txt" in err and snapshot(tmp_path) == before
    shutil.move(out / "notes.txt", tmp_path / "notes.txt")
    shutil.move(out / "my_folder", tmp_path / "my_folder")
    assert main([*overwrite, "--max_steps", "1"]) == 0
    after = snapshot(out)
    assert {k: v for k, v in after.items() if k.startswith("eval_ck1")} == {
        k: v for k, v in kept.items() if k.startswith("eval_ck1")
    }
    assert not (out / "checkpoint-2").exists() and (out / "checkpoint-1").exists()


@pytest.mark.parametrize(
    "rows, extra, message",
    [
        (
            3,
            [],
            "The training data has 3 problem(s), fewer than one generation batch takes (4: "
            "generation_batch_size 8 / num_generations 2); TRL drops an incomplete generation batch, so this run would "
            "train 0 steps.",
        ),  # fmt: skip
        (16, ["--max_steps", "-1", "--num_train_epochs", "0"], "num_train_epochs=0.0 with max_steps=-1 trains 0 steps"),
    ],
)
def test_a_run_that_would_train_no_step_is_refused_before_loading(
    rows, extra, message, tiny_model_path, problems_file, tmp_path, no_model_loading, capsys
):
    """D5: not 0 steps, exit 0 and the untrained model saved as the final model."""
    data = tmp_path / "few.jsonl"
    data.write_text("".join(open(problems_file).readlines()[:rows]))
    out = tmp_path / "out"
    argv = ["--config", RECIPE, *_cpu_overrides(tiny_model_path, str(data), str(out)), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"opefo-train: error: {message}" in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--max_steps", "0"], "max_steps=0 asks for no step, and transformers would still train one"),
        (["--top_p", "0"], "top_p=0.0: nucleus sampling keeps the most likely tokens"),
        (["--top_p", "1.5"], "top_p=1.5: nucleus sampling keeps the most likely tokens"),
        (["--beta", "-0.1"], "beta=-0.1: the KL coefficient must be >= 0"),
        (["--num_generations", "0"], "num_generations=0: GRPO compares each completion with the others"),
        (["--seed", "-1"], "seed=-1: seeds must be in [0, 2**32 - 1]"),
        (["--epsilon", "-0.2"], "epsilon=-0.2: the clip range [1 - epsilon, 1 + epsilon_high] needs epsilon > 0"),
        (["--epsilon", "0"], "epsilon=0.0: the clip range [1 - epsilon, 1 + epsilon_high] needs epsilon > 0"),
        (["--epsilon_high", "0.1"], "epsilon_high=0.1 is below epsilon=0.2"),
        (["--vllm_gpu_memory_utilization", "1.5"], "vllm_gpu_memory_utilization must be in (0, 1]"),
        (["--vllm_gpu_memory_utilization", "0"], "vllm_gpu_memory_utilization must be in (0, 1]"),
        (["--vllm_tensor_parallel_size", "0"], "vllm_tensor_parallel_size must be at least 1, got 0."),
        (["--context_length", "8192"], "context_length=8192 is above the 1024 positions of"),
        (["--use_peft", "true"], "dropout in training (lora_dropout=0.05; disable_dropout=False) is not modelled"),
    ],
)
def test_values_that_train_nothing_or_something_else_are_refused_before_loading(
    extra, message, tiny_model_path, problems_file, tmp_path, no_model_loading, capsys
):
    """D, F, J, P, Q, N: each of these trained silently (or something else than asked), or failed with a traceback."""
    out = tmp_path / "out"
    argv = ["--config", RECIPE, *_cpu_overrides(tiny_model_path, problems_file, str(out)), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"opefo-train: error: {message}" in err and "Traceback" not in err
    assert not out.exists()


def test_a_context_length_beyond_the_models_positions_is_taken_when_said(
    tiny_model_path, problems_file, tmp_path, monkeypatch
):
    import opefo_trl.cli.train as cli

    checked = []
    monkeypatch.setattr(cli, "output_dir_policy", lambda *a: checked.append(a) or _NoPolicy())
    argv = ["--config", RECIPE, *_cpu_overrides(tiny_model_path, problems_file, str(tmp_path / "out"))]
    script_args, training_args, model_args = parse_args([*argv, "--context_length", "8192"])
    with pytest.raises(ValueError, match="--context_length_beyond_model true if the model does handle"):
        cli.prepare_inputs(script_args, training_args, model_args)
    script_args, training_args, model_args = parse_args(
        [*argv, "--context_length", "8192", "--context_length_beyond_model", "true"]
    )
    dataset, _ = cli.prepare_inputs(script_args, training_args, model_args)
    assert len(dataset) == 16


class _NoPolicy:
    def check(self):
        pass

    def check_resume(self, steps, inputs=None, steps_per_epoch=None):
        pass


@pytest.mark.parametrize("mode, message", [("server", "vllm_mode='server' sends the weights to the server over NCCL")])
def test_vllm_refusals_are_one_line_before_loading(
    mode, message, tiny_model_path, problems_file, tmp_path, no_model_loading, monkeypatch, capsys
):
    """M, N: use_vllm without vLLM installed failed after the model loaded; the refusals of what this machine cannot
    run with vLLM were a ValueError traceback."""
    import importlib.util

    out = tmp_path / "out"
    argv = ["--config", RECIPE, *_cpu_overrides(tiny_model_path, problems_file, str(out)), "--use_vllm", "true"]
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real_find_spec(name))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("opefo-train: error: ") and len(err.strip().splitlines()) == 1
    assert "use_vllm=True but vLLM is not installed: `pip install 'opefo-trl[vllm]'`" in err
    installed = importlib.machinery.ModuleSpec("vllm", None)
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: installed if name == "vllm" else real_find_spec(name)
    )
    assert main([*argv, "--vllm_mode", mode]) == 2
    err = capsys.readouterr().err
    assert f"opefo-train: error: {message}" in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize(
    "gold, shown", [({"v": "27"}, "is a dict ({'v': '27'})"), (True, "is a bool (True)"), ([1, False], "is a bool")]
)
def test_a_gold_answer_of_the_wrong_type_is_refused_naming_column_and_row(
    gold, shown, tiny_model_path, problems_file, tmp_path, no_model_loading, capsys
):
    """K: a dict or a bool reached the rewards as its Python repr ("{'v': '27'}", 'True')."""
    rows = [json.loads(line) for line in open(problems_file)]
    rows[5]["solution"] = gold
    data = tmp_path / "typed.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out"
    assert main(["--config", RECIPE, *_cpu_overrides(tiny_model_path, str(data), str(out))]) == 2
    err = capsys.readouterr().err
    assert f"opefo-train: error: The gold answer in column 'solution', row 5, {shown}" in err
    assert "Traceback" not in err and not out.exists()


KILLED_FINAL_SAVE = """
import os, signal, sys

from opefo_trl.runs import RunFolder

original = RunFolder.declare


def killed_while_moving_the_final_model(self, names):
    original(self, names)
    if "model.safetensors" in names:  # every file of the final model is named in the manifest: kill -9 here
        os.kill(os.getpid(), signal.SIGKILL)


RunFolder.declare = killed_while_moving_the_final_model
from opefo_trl.cli.train import main

sys.exit(main(sys.argv[1:]))
"""


def test_a_resume_of_a_finished_run_trains_nothing_and_keeps_its_final_model(
    tiny_model_path, problems_file, tmp_path, reward_module, capsys, snapshot
):
    """D3: resuming a run whose last checkpoint is at (or past) max_steps trained one more step and saved it over the
    final model; so did resuming after a kill -9 while the final model was moved into place."""
    out = tmp_path / "out"
    reward = ["--reward_funcs", "opefo_cli_test_rewards.digit_overlap_reward"]
    argv = ["--config", RECIPE, *_cpu_overrides(tiny_model_path, problems_file, str(out), max_steps=2), *reward]
    assert main([*argv, "--save_steps", "1"]) == 0
    capsys.readouterr()
    before = snapshot(tmp_path)
    for resume, steps in ((["true"], "2"), ([str(out / "checkpoint-2")], "1"), ([str(out / "checkpoint-1")], "1")):
        assert main([*argv, "--max_steps", steps, "--resume_from_checkpoint", *resume]) == 2
        err = capsys.readouterr().err
        checkpoint = out / ("checkpoint-1" if resume[0].endswith("1") else "checkpoint-2")
        assert (
            f"opefo-train: error: Nothing to resume: {checkpoint} is at step {checkpoint.name[-1]}, and this run "
            f"trains {steps} step(s)"
        ) in err
        assert snapshot(tmp_path) == before

    killed_dir = tmp_path / "killed"
    killed_argv = [
        "--config", RECIPE, *_cpu_overrides(tiny_model_path, problems_file, str(killed_dir), max_steps=2), *reward,
    ]  # fmt: skip
    killed = _start(tmp_path / "..", [*killed_argv, "--save_steps", "1"], KILLED_FINAL_SAVE, PYTHONPATH=str(tmp_path))
    output = killed.communicate(timeout=600)[0].decode()
    assert killed.returncode == -9, output[-3000:]
    metrics = (killed_dir / "metrics.jsonl").read_text()
    checkpoint = snapshot(killed_dir / "checkpoint-2")
    assert main([*killed_argv, "--resume_from_checkpoint", "true"]) == 2
    assert f"Nothing to resume: {killed_dir / 'checkpoint-2'} is at step 2" in capsys.readouterr().err
    assert (killed_dir / "metrics.jsonl").read_text() == metrics and snapshot(killed_dir / "checkpoint-2") == checkpoint


KILLED_MID_MOVE = """
import os, signal, sys

import opefo_trl.runs.folder as folder

original = folder.remove_entry
moving = []


def killed_after_the_first_file_moved(path):
    staged = os.path.join(os.path.dirname(path), ".opefo_final_model", os.path.basename(path))
    if os.path.exists(staged):  # about to move this file of the saved final model into place
        moving.append(path)
        if len(moving) == 2:  # one file is in place, the others still staged: the signal the test names
            kill = getattr(signal, os.environ["OPEFO_KILL_SIGNAL"])
            if signal.getsignal(kill) is signal.SIG_IGN:  # inherited (SIGHUP under nohup): simulate a run it kills
                signal.signal(kill, signal.SIG_DFL)
            os.kill(os.getpid(), kill)
    original(path)


folder.remove_entry = killed_after_the_first_file_moved
from opefo_trl.cli.train import main

sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize(
    "save, signal_name, resume",
    [("no", "SIGKILL", False), ("steps", "SIGKILL", True), ("no", "SIGTERM", True), ("steps", "SIGHUP", False)],
)
def test_a_final_model_whose_move_was_killed_is_moved_into_place_by_the_next_command(
    save, signal_name, resume, tiny_model_path, problems_file, tmp_path, reward_module, caplog, capsys
):
    """B: a run killed while moving its saved final model into place left the whole model staged in
    .opefo_final_model, and the next command (refused, as a rerun or a resume) deleted it: the only copy of the
    training when no checkpoint was saved. Now the next command moves it into place, and says so."""
    import signal

    from opefo_trl.runs import FINAL_MODEL_STAGING, read_manifest, run_files

    out = tmp_path / "out"
    reward = ["--reward_funcs", "opefo_cli_test_rewards.digit_overlap_reward"]
    saving = ["--save_strategy", "no"] if save == "no" else ["--save_steps", "1"]
    argv = ["--config", RECIPE, *_cpu_overrides(tiny_model_path, problems_file, str(out), max_steps=2), *reward]
    killed = _start(
        tmp_path / "..", [*argv, *saving], KILLED_MID_MOVE, PYTHONPATH=str(tmp_path), OPEFO_KILL_SIGNAL=signal_name
    )
    output = killed.communicate(timeout=600)[0].decode()
    assert killed.returncode == -getattr(signal, signal_name), output[-3000:]
    staging = out / FINAL_MODEL_STAGING
    staged = {n: (staging / n).read_bytes() for n in os.listdir(staging) if not n.startswith(".")}
    run_own = ("metrics.jsonl", "README.md")  # README.md: the model card each checkpoint save writes
    named = [n for n in read_manifest(str(out)) if n not in run_own and not n.startswith("checkpoint-")]
    in_place = {n: (out / n).read_bytes() for n in named if (out / n).exists()}
    assert len(in_place) == 1 and set(named) == {*staged, *in_place}  # killed half way through the move
    assert "model.safetensors" in staged
    final_model = {**staged, **in_place}

    with caplog.at_level("WARNING"):
        assert main([*argv, *saving, *(["--resume_from_checkpoint", "true"] if resume else [])]) == 2
    err = capsys.readouterr().err
    assert {n: (out / n).read_bytes() for n in final_model if (out / n).exists()} == final_model  # byte for byte
    assert not staging.exists() and set(final_model) <= set(run_files(str(out)))
    assert f"its whole final model ({', '.join(sorted(staged))}) is now in {out}" in caplog.text
    if save == "steps" and resume:
        assert f"Nothing to resume: {out / 'checkpoint-2'} is at step 2" in err
        assert f"its final model in {out} is left as it is" in err
    elif resume:
        assert "opefo-train: error: " in err and "Traceback" not in err
    else:
        assert f"opefo-train: error: output_dir '{out}' holds an earlier run (" in err and "model.safetensors" in err


def test_a_hub_data_set_missing_from_the_offline_cache_is_one_line(tiny_model_path, tmp_path, no_model_loading, capsys):
    """With HF_HUB_OFFLINE=1, a data set not in the cache gave datasets' ConnectionError (OfflineModeIsEnabled)."""
    assert os.environ["HF_HUB_OFFLINE"] == "1"  # as the tests run
    out = tmp_path / "out"
    argv = [*_cpu_overrides(tiny_model_path, "", str(out)), "--dataset_name", "opefo-trl-tests/never-cached"]
    argv.remove("--dataset_files"), argv.remove("")
    extra = ["--problem_column", "question", "--answer_column", "final_answer"]
    assert main(["--config", RECIPE, *argv, *extra]) == 2
    err = capsys.readouterr().err
    assert (
        "opefo-train: error: Data set 'opefo-trl-tests/never-cached' is not in the local datasets cache, and the hub "
        "cannot be reached (HF_HUB_OFFLINE is set: "
    ) in err
    assert "Download it once with network access and HF_HUB_OFFLINE unset" in err and "Traceback" not in err


def test_a_hub_configuration_given_with_local_files_is_refused(tiny_model_path, problems_file, tmp_path, capsys):
    """dataset_config with dataset_files: the files were read, the configuration ignored without a word."""
    out = tmp_path / "out"
    argv = ["--config", RECIPE, *_cpu_overrides(tiny_model_path, problems_file, str(out)), "--dataset_config", "main"]
    with pytest.raises(ValueError, match="dataset_config 'main' names a configuration of a hub data set, but dataset_"):
        parse_args(argv)  # before anything loads
    assert main(argv) == 2
    assert "opefo-train: error: dataset_config 'main' names a configuration" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("cut_to", [100, 4000, "half"])
def test_cut_off_weights_are_one_line_naming_the_file_and_the_fix(
    cut_to, tiny_model_path, problems_file, tmp_path, no_model_loading, capsys
):
    """A model.safetensors cut short (what an interrupted copy leaves) gave safetensors' own SafetensorError."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_path, model)
    weights = model / "model.safetensors"
    size = weights.stat().st_size // 2 if cut_to == "half" else cut_to
    os.truncate(weights, size)
    out = tmp_path / "out"
    assert main(["--config", RECIPE, *_cpu_overrides(str(model), problems_file, str(out))]) == 2
    err = capsys.readouterr().err
    assert f"opefo-train: error: {weights} ({size} bytes) cannot be read by safetensors (cut short or " in err
    assert "Copy that file again from where it came from" in err and "Traceback" not in err and not out.exists()


def test_a_run_folder_without_a_checkpoint_names_the_one_command_that_works(
    tiny_model_path, problems_file, tmp_path, reward_module, capsys, snapshot
):
    """A folder holding a run's metrics and no checkpoint: the resume was told to "drop resume_from_checkpoint to
    start afresh", and the plain rerun to "Resume it with --resume_from_checkpoint true"; each is refused. Only the
    overwrite works, and both now name it."""
    out = tmp_path / "out"
    record_in_manifest(str(out), ["metrics.jsonl"])
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    reward = ["--reward_funcs", "opefo_cli_test_rewards.digit_overlap_reward"]
    argv = ["--config", RECIPE, *_cpu_overrides(tiny_model_path, problems_file, str(out)), *reward]
    before = snapshot(out)
    assert main([*argv, "--resume_from_checkpoint", "true"]) == 2
    err = capsys.readouterr().err
    assert (
        f"opefo-train: error: resume_from_checkpoint=true but output_dir '{out}' has no checkpoint-<step> folder: its "
        "earlier run (metrics.jsonl) saved none. Start afresh in it with --overwrite_output_dir true and without "
        "--resume_from_checkpoint (the overwrite deletes those files once the new run has saved something)"
    ) in err
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert (
        f"opefo-train: error: output_dir '{out}' holds an earlier run (metrics.jsonl) that saved no whole checkpoint to"
        " resume; training into it would mix the two runs. Start afresh in it with --overwrite_output_dir true (the "
    ) in err
    assert "Resume it" not in err and snapshot(out) == before
    assert main([*argv, "--overwrite_output_dir", "true"]) == 0  # the command they name
    assert '"loss": 0.5' not in (out / "metrics.jsonl").read_text() and (out / "model.safetensors").exists()


KILLED_BEFORE_THE_MARK = """
import os, signal, sys

import transformers

from opefo_trl.runs import FINAL_MODEL_STAGING, RunFolder


def kill():
    os.kill(os.getpid(), signal.SIGKILL)


if os.environ["OPEFO_KILL_AT"] == "mark":  # save_model has returned on every process; the staged model is unmarked
    RunFolder.publish_final_model = lambda self, staging: kill()
else:  # inside save_model: config and weights written, the tokenizer and training_args.bin not yet
    original = transformers.PreTrainedModel.save_pretrained

    def killed_after_the_weights(self, save_directory, *args, **kwargs):
        original(self, save_directory, *args, **kwargs)
        if os.path.basename(os.path.normpath(save_directory)) == FINAL_MODEL_STAGING:
            kill()

    transformers.PreTrainedModel.save_pretrained = killed_after_the_weights
from opefo_trl.cli.train import main

sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("kill_at, resume", [("mark", False), ("mark", True), ("weights", False), ("weights", True)])
def test_a_final_model_killed_before_it_was_marked_whole_is_never_deleted(
    kill_at, resume, tiny_model_path, problems_file, tmp_path, reward_module, caplog, capsys
):
    """The next command (a resume or a rerun) deleted a run's final model staged without checkpoints, when a kill -9
    came after save_model returned and before the model was marked whole, or inside save_model after its weights: the
    only copy of the training. Now a whole one (save_model's files all there and readable) is moved into place, and
    one that is not is kept under its own name, the command saying where and how to take or discard it."""
    from opefo_trl.runs import FINAL_MODEL_STAGING, UNFINISHED_FINAL_MODEL, run_files

    out = tmp_path / "out"
    reward = ["--reward_funcs", "opefo_cli_test_rewards.digit_overlap_reward"]
    argv = [
        "--config", RECIPE, *_cpu_overrides(tiny_model_path, problems_file, str(out), max_steps=2), *reward,
        "--save_strategy", "no",
    ]  # fmt: skip
    killed = _start(tmp_path / "..", argv, KILLED_BEFORE_THE_MARK, PYTHONPATH=str(tmp_path), OPEFO_KILL_AT=kill_at)
    output = killed.communicate(timeout=600)[0].decode()
    assert killed.returncode == -9, output[-3000:]
    staging = out / FINAL_MODEL_STAGING
    staged = {n: (staging / n).read_bytes() for n in os.listdir(staging)}
    assert "model.safetensors" in staged and ("training_args.bin" in staged) == (kill_at == "mark")
    again = [*argv, *(["--resume_from_checkpoint", "true"] if resume else [])]

    with caplog.at_level("WARNING"):
        assert main(again) == 2
    err = capsys.readouterr().err
    assert not staging.exists() and "Traceback" not in err
    if kill_at == "mark":  # whole: in place, byte for byte, as an uninterrupted run leaves it
        assert {n: (out / n).read_bytes() for n in staged} == staged and set(staged) <= set(run_files(str(out)))
        assert f"its whole final model ({', '.join(sorted(staged))}) is now in {out}" in caplog.text
        assert "--resume_from_checkpoint true" not in err and "--overwrite_output_dir true" in err
        return
    kept = out / UNFINISHED_FINAL_MODEL
    assert {n: (kept / n).read_bytes() for n in os.listdir(kept)} == staged
    assert (
        f"opefo-train: error: output_dir '{out}' holds the final model of a run killed while saving it, kept in "
        f"{kept}" in err
    )
    assert f"rm -r {kept}" in err and "training_args.bin is missing" in err
    assert main(again) == 2  # said again, deleted never
    assert {n: (kept / n).read_bytes() for n in os.listdir(kept)} == staged
    assert f"kept in {kept}" in capsys.readouterr().err


def test_a_checkpoint_without_its_options_file_is_compared_through_its_training_args(
    tiny_model_path, problems_file, tmp_path, reward_module, capsys, snapshot
):
    """E: a checkpoint of the previous release (no opefo_run_options.json) resumed with another learning rate or
    num_generations gave exit 0, and the restored scheduler kept the old learning rate."""
    from opefo_trl.runs import RUN_OPTIONS_NAME, mark_checkpoint_complete

    out = tmp_path / "out"
    reward = ["--reward_funcs", "opefo_cli_test_rewards.digit_overlap_reward"]
    argv = ["--config", RECIPE, *_cpu_overrides(tiny_model_path, problems_file, str(out), save_steps=1), *reward]
    assert main(argv) == 0
    checkpoint = out / "checkpoint-1"
    os.remove(checkpoint / RUN_OPTIONS_NAME)
    mark_checkpoint_complete(str(checkpoint))  # whole, as the previous release wrote it
    capsys.readouterr()
    before = snapshot(tmp_path)
    resume = [*argv, "--max_steps", "2", "--resume_from_checkpoint", "true"]
    for extra, refused in (
        (["--learning_rate", "1e-3"], "learning_rate 2.83e-06 -> 0.001: the checkpoint's scheduler and optimizer"),
        (["--num_generations", "4"], "num_generations 2 -> 4: the steps already trained would stand for other"),
    ):
        assert main([*resume, *extra]) == 2
        err = capsys.readouterr().err
        assert f"opefo-train: error: Cannot resume {checkpoint} with other options than it was trained with: " in err
        assert refused in err and "Traceback" not in err
        assert snapshot(tmp_path) == before
    assert main(resume) == 0


def test_files_a_user_put_inside_a_checkpoint_are_never_deleted_unsaid(
    tiny_model_path, problems_file, tmp_path, reward_module, capsys, caplog, snapshot
):
    """A: an overwrite, a resume that saves a step again, and save_total_limit deleted the user's files inside a
    checkpoint (an `opefo-eval -o run/checkpoint-1/eval` store, a note), exit 0 and nothing said."""
    out = tmp_path / "out"
    reward = ["--reward_funcs", "opefo_cli_test_rewards.digit_overlap_reward"]
    argv = ["--config", RECIPE, *_cpu_overrides(tiny_model_path, problems_file, str(out), save_steps=1), *reward]
    assert main([*argv, "--max_steps", "2"]) == 0
    (out / "checkpoint-1" / "eval").mkdir()
    (out / "checkpoint-1" / "eval" / "samples.jsonl").write_text('{"sample": 1}\n')
    (out / "checkpoint-2" / "notes.txt").write_text("lr too low?")
    capsys.readouterr()
    before = snapshot(tmp_path)

    assert main([*argv, "--max_steps", "2", "--overwrite_output_dir", "true"]) == 2
    err = capsys.readouterr().err
    assert (
        f"opefo-train: error: overwrite_output_dir would delete {out / 'checkpoint-1'}, which holds files that no run "
        f"of opefo-train wrote: eval/samples.jsonl. Move them out of {out / 'checkpoint-1'}, then run the command "
        "again."
    ) in err
    assert snapshot(tmp_path) == before
    resume_1 = ["--max_steps", "2", "--resume_from_checkpoint", str(out / "checkpoint-1")]
    assert main([*argv, *resume_1]) == 2
    assert (
        f"opefo-train: error: This resume would save again over (it trains the steps after checkpoint-1 anew) "
        f"{out / 'checkpoint-2'}, which holds files that no run of opefo-train wrote: notes.txt."
    ) in capsys.readouterr().err
    assert snapshot(tmp_path) == before

    os.remove(out / "checkpoint-2" / "notes.txt")
    with caplog.at_level("WARNING"):
        assert main([*argv, "--max_steps", "3", "--save_total_limit", "1", "--resume_from_checkpoint", "true"]) == 0
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-1", "checkpoint-3"]
    assert (out / "checkpoint-1" / "eval" / "samples.jsonl").read_text() == '{"sample": 1}\n'
    assert f"save_total_limit: {out / 'checkpoint-1'} is kept, not rotated out" in caplog.text


def test_a_resume_with_options_the_checkpoint_would_override_is_refused_and_others_are_said(
    tiny_model_path, problems_file, tmp_path, reward_module, capsys, caplog, snapshot
):
    """D4: a new learning rate was dropped without a word (the restored scheduler keeps the old one); a new batch
    shape, num_generations or seed was taken without a word (the epoch counter jumped back); a new length too."""
    out = tmp_path / "out"
    reward = ["--reward_funcs", "opefo_cli_test_rewards.digit_overlap_reward"]
    argv = ["--config", RECIPE, *_cpu_overrides(tiny_model_path, problems_file, str(out), save_steps=1), *reward]
    assert main(argv) == 0
    checkpoint = out / "checkpoint-1"
    assert json.loads((checkpoint / "opefo_run_options.json").read_text())["learning_rate"] == 2.83e-6
    resume = [*argv, "--max_steps", "2", "--resume_from_checkpoint", "true"]
    before = snapshot(tmp_path)
    for extra, refused in (
        (["--learning_rate", "1e-5"], "learning_rate 2.83e-06 -> 1e-05: the checkpoint's scheduler and optimizer"),
        (
            ["--gradient_accumulation_steps", "1"],
            "gradient_accumulation_steps 2 -> 1, steps_per_generation 2 -> 1, "
            "generation_batch_size 8 -> 4: the steps already trained would stand for other prompts",
        ),  # fmt: skip
        (["--num_generations", "4"], "num_generations 2 -> 4: the steps already trained"),
        (["--seed", "7"], "seed 42 -> 7: every epoch's prompt order is drawn from it"),
    ):
        assert main([*resume, *extra]) == 2
        err = capsys.readouterr().err
        assert f"opefo-train: error: Cannot resume {checkpoint} with other options than it was trained with: " in err
        assert refused in err and "Traceback" not in err
        assert snapshot(tmp_path) == before
    with caplog.at_level("WARNING"):
        assert main([*resume, "--max_completion_length", "16", "--temperature", "0.7"]) == 0
    assert f"Resuming {checkpoint} with max_completion_length 8 -> 16 from step 1 on." in caplog.text
    assert f"Resuming {checkpoint} with temperature 1.0 -> 0.7 from step 1 on." in caplog.text
    assert [m["step"] for m in _metrics(str(out)) if "reward" in m] == [1, 2]


def test_a_resume_with_other_data_or_rewards_is_refused_and_a_checkpoint_that_records_none_says_so(
    tiny_model_path, problems_file, tmp_path, reward_module, capsys, caplog, snapshot
):
    """I: a resume with another data file or reward function was neither compared nor mentioned (exit 0), although a
    changed seed was refused. The data is known by its bytes: the same file moved elsewhere resumes."""
    import hashlib

    from opefo_trl.runs import RUN_OPTIONS_NAME, mark_checkpoint_complete

    out = tmp_path / "out"
    rewards = ["--reward_funcs", "math_accuracy_reward", "opefo_cli_test_rewards.digit_overlap_reward"]
    argv = ["--config", RECIPE, *_cpu_overrides(tiny_model_path, problems_file, str(out), save_steps=1), *rewards]
    assert main(argv) == 0
    checkpoint = out / "checkpoint-1"
    data_hash = hashlib.sha256(Path(problems_file).read_bytes()).hexdigest()
    recorded = json.loads((checkpoint / RUN_OPTIONS_NAME).read_text())
    assert (recorded["training_data"], recorded["reward_funcs"], recorded["math_reward_mode"]) == (
        f"problems.jsonl (sha256 {data_hash})",
        ["math_accuracy_reward", "opefo_cli_test_rewards.digit_overlap_reward"],
        "equivalent",
    )
    assert recorded["prompt_template"] == "qwen_math_boxed"
    # The final model records them too: opefo-eval reads the prompt template and reward mode from there (issue 53).
    assert json.loads((out / RUN_OPTIONS_NAME).read_text()) == recorded
    edited, moved = tmp_path / "edited" / "problems.jsonl", tmp_path / "moved" / "problems.jsonl"
    for copy in (edited, moved):
        copy.parent.mkdir()
        shutil.copy(problems_file, copy)
    edited.write_text(edited.read_text().replace('"What is 2 + 1?"', '"What is 2 + 2?"', 1))
    edited_hash = hashlib.sha256(edited.read_bytes()).hexdigest()
    resume = [*argv, "--max_steps", "2", "--resume_from_checkpoint", "true"]
    capsys.readouterr()
    before = snapshot(out)
    for extra, refused in (
        (
            ["--dataset_files", str(edited)],
            f"training_data problems.jsonl (sha256 {data_hash}) -> problems.jsonl (sha256 {edited_hash}): the steps "
            "already trained learned from other data or rewards, which the resumed run would mix with these.",
        ),
        (
            ["--reward_funcs", "math_accuracy_reward"],
            "reward_funcs ['math_accuracy_reward', 'opefo_cli_test_rewards.digit_overlap_reward'] -> "
            "['math_accuracy_reward']: the steps already trained learned from other data or rewards",
        ),
        (["--math_reward_mode", "strict"], "math_reward_mode equivalent -> strict: the steps already trained learned"),
        (
            ["--prompt_template", "worked_example"],
            "prompt_template qwen_math_boxed -> worked_example: the steps already trained learned from other data",
        ),
    ):  # fmt: skip
        assert main([*resume, *extra]) == 2
        err = _cli_error(capsys.readouterr().err)
        assert err.startswith(f"opefo-train: error: Cannot resume {checkpoint} with other options than it was ")
        assert refused in err and len(err.strip().splitlines()) == 1
        assert snapshot(out) == before
    assert main([*resume, "--dataset_files", str(moved)]) == 0  # the same bytes elsewhere: the same data

    # A checkpoint of an earlier version records neither: it resumes, and says once that nothing was compared.
    options = json.loads((checkpoint / RUN_OPTIONS_NAME).read_text())
    for name in ("training_data", "prompt_template", "reward_funcs", "math_reward_mode"):
        del options[name]
    (checkpoint / RUN_OPTIONS_NAME).write_text(json.dumps(options))
    mark_checkpoint_complete(str(checkpoint))
    resume_1 = [*argv, "--max_steps", "2", "--resume_from_checkpoint", str(checkpoint), "--dataset_files", str(edited)]
    with caplog.at_level("WARNING"):
        assert main(resume_1) == 0
    said = (
        f"Resuming {checkpoint}, which records no training_data, prompt_template, reward_funcs, math_reward_mode "
        "(saved by an earlier version of opefo-trl): they are not compared with this run's."
    )
    assert caplog.text.count(said) == 1


COLUMN_REWARDS_MODULE = '''
SEEN = []


def mutating_reward(completions, solution, difficulty, **kwargs):
    """Changes its inputs in place: the next reward function must not see it."""
    scores = [float(d) for d in difficulty]
    solution[:] = ["changed"] * len(solution)
    difficulty.clear()
    completions[0][-1]["content"] = "changed"
    return scores


def recording_reward(completions, solution, difficulty, source, **kwargs):
    SEEN.append((list(solution), list(difficulty), list(source), completions[0][-1]["content"]))
    return [0.0 for _ in completions]
'''


def test_reward_functions_get_the_extra_columns_each_its_own_copy(
    tiny_model_path, problems_file, tmp_path, monkeypatch
):
    """D15/D16: extra data columns were dropped before the reward functions (TRL passes them), and a reward function
    that changed its inputs changed what the next one was given."""
    rows = [json.loads(line) for line in open(problems_file)]
    data = tmp_path / "problems.jsonl"
    data.write_text(
        "".join(json.dumps({**r, "difficulty": i % 3, "source": f"s{i}"}) + "\n" for i, r in enumerate(rows))
    )
    (tmp_path / "opefo_cli_column_rewards.py").write_text(COLUMN_REWARDS_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = __import__("opefo_cli_column_rewards")
    argv = [
        "--config", RECIPE, *_cpu_overrides(tiny_model_path, str(data), str(tmp_path / "out")),
        "--reward_funcs", "opefo_cli_column_rewards.mutating_reward", "opefo_cli_column_rewards.recording_reward",
    ]  # fmt: skip
    try:
        assert main(argv) == 0
    finally:
        __import__("sys").modules.pop("opefo_cli_column_rewards", None)
    gold = {r["solution"]: (i % 3, f"s{i}") for i, r in enumerate(rows)}
    seen = [
        (s, d, src)
        for solutions, difficulties, sources, _ in module.SEEN
        for s, d, src in zip(solutions, difficulties, sources, strict=True)
    ]
    assert len(seen) == 8  # 4 prompts x 2 completions, each with its own row's columns
    assert all(gold[s] == (d, src) for s, d, src in seen)
    assert all(text != "changed" for *_, text in module.SEEN)


def test_the_math_reward_mode_from_a_recipe_or_the_command_line_builds_the_reward_trained_on(
    tiny_model_path, problems_file, tmp_path, monkeypatch
):
    import opefo_trl.cli.train as cli

    monkeypatch.setattr(cli, "output_dir_policy", lambda *a: _NoPolicy())
    argv = ["--config", RECIPE, *_cpu_overrides(tiny_model_path, problems_file, str(tmp_path / "out"))]
    restated = [[{"role": "assistant", "content": "The answer is 6 + 3."}]]
    for extra, paid in (([], 1.0), (["--math_reward_mode", "strict"], 0.0)):
        script_args, training_args, model_args = parse_args([*argv, *extra])
        _, (reward,) = cli.prepare_inputs(script_args, training_args, model_args)
        assert reward(restated, solution=["9"]) == [paid]
    recipe = tmp_path / "strict.yaml"
    recipe.write_text(RECIPE_TEXT + "\nmath_reward_mode: strict\n")
    assert (
        parse_args(["--config", str(recipe), "--use_cpu", "true", "--report_to", "none"])[0].math_reward_mode
        == "strict"
    )
    recipe.write_text(RECIPE_TEXT + "\nmath_reward_mode: final\n")
    with pytest.raises(ValueError, match="math_reward_mode='final' is not a mode of the math reward"):
        parse_args(["--config", str(recipe), "--use_cpu", "true", "--report_to", "none"])


def test_exit_before_finalization_runs_exit_handlers_and_flushes(tmp_path):
    """A multi-process gloo run leaves through this: the trackers' atexit handlers and buffered output must not be
    lost with the skipped finalization, and the status is the one given."""
    marker = tmp_path / "atexit-ran"
    code = (
        "import atexit, sys\n"
        "from opefo_trl.cli.train import exit_before_finalization\n"
        f"atexit.register(lambda: open({str(marker)!r}, 'w').write('ok'))\n"
        "sys.stdout.write('buffered line')\n"
        "exit_before_finalization(3)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 3, result.stderr[-2000:]
    assert result.stdout == "buffered line"
    assert marker.read_text() == "ok"


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda s: [s], "config.json holds a JSON list, not a mapping of the model's settings"),
        (
            lambda s: {**s, "vocab_size": s["vocab_size"] + 64},
            "config.json says vocab_size=384, but the model.embed_tokens.weight of model.safetensors has 320 rows",
        ),
    ],
    ids=["list", "vocab_size"],
)
def test_a_model_config_that_does_not_fit_its_weights_is_one_line_before_loading(
    edit, message, tiny_model_path, problems_file, tmp_path, no_model_loading, capsys, snapshot
):
    """S: a TypeError traceback while loading the tokenizer (a list), transformers' "mismatched sizes" RuntimeError
    after loading (vocab_size)."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_path, model)
    settings = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(edit(settings)))
    argv = ["--config", RECIPE, *_cpu_overrides(str(model), problems_file, str(tmp_path / "out"))]
    before = snapshot(tmp_path)
    assert main(argv) == 2
    err = _cli_error(capsys.readouterr().err)
    assert err.startswith(f"opefo-train: error: {model}/config.json" if "list" in message else "opefo-train: error: ")
    assert message in err and "restore the config.json saved with these weights" in err.lower()
    assert snapshot(tmp_path) == before


def _error_lines(err: str) -> list[str]:
    """The lines of stderr that say "error", each from its ``opefo-train: error:`` on (after a progress bar)."""
    lines = [line for line in err.splitlines() if "error" in line.lower()]
    return [line[line.find("opefo-train: error:") :] if "opefo-train: error:" in line else line for line in lines]


def _poison(weights_file, tensor, value):
    """Set one entry of ``tensor`` in the safetensors file ``weights_file`` to ``value`` (a diverged run's weights)."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(weights_file))
    weights[tensor].view(-1)[1] = value
    save_file(weights, str(weights_file), metadata={"format": "pt"})


@pytest.fixture
def no_generation(monkeypatch):
    """Fail the test if a completion is ever sampled."""
    import trl

    def refuse(*args, **kwargs):
        raise AssertionError("a completion was about to be sampled")

    monkeypatch.setattr(trl.GRPOTrainer, "_generate_single_turn", refuse)


def test_weights_holding_nan_or_inf_are_one_line_before_the_first_generation(
    tiny_model_path, problems_file, tmp_path, reward_module, no_generation, capsys
):
    """R: torch's "probability tensor contains either `inf`, `nan` or element < 0" RuntimeError traceback at the first
    generation."""
    model = tmp_path / "diverged"
    shutil.copytree(tiny_model_path, model)
    _poison(model / "model.safetensors", "model.layers.1.self_attn.q_proj.weight", float("nan"))
    _poison(model / "model.safetensors", "model.norm.weight", float("-inf"))
    out = tmp_path / "out"
    argv = [
        "--config", RECIPE, *_cpu_overrides(str(model), problems_file, str(out)),
        "--reward_funcs", "opefo_cli_test_rewards.digit_overlap_reward",
    ]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and _error_lines(err) == [
        f"opefo-train: error: The weights of {model} hold NaN or inf (2 tensor(s): "
        "model.layers.1.self_attn.q_proj.weight, model.norm.weight): sampling from them fails at the first "
        "generation (a probability tensor holding NaN), and no update can make them finite again. Train from finite "
        "weights: the base model, or an earlier checkpoint of the run that wrote these."
    ]
    assert not out.exists()  # the refused run left nothing


def test_a_resumed_checkpoint_whose_weights_hold_inf_is_one_line_naming_it(
    tiny_model_path, problems_file, tmp_path, reward_module, monkeypatch, capsys
):
    """R, on a resume: the checkpoint's weights (loaded over the model's by the resume) are the ones checked."""
    out = tmp_path / "out"
    argv = [
        "--config", RECIPE, *_cpu_overrides(tiny_model_path, problems_file, str(out), save_steps=1),
        "--reward_funcs", "opefo_cli_test_rewards.digit_overlap_reward",
    ]  # fmt: skip
    assert main(argv) == 0
    checkpoint = out / "checkpoint-1"
    _poison(checkpoint / "model.safetensors", "model.embed_tokens.weight", float("inf"))
    capsys.readouterr()
    import trl

    monkeypatch.setattr(trl.GRPOTrainer, "_generate_single_turn", None)  # a call would be a TypeError traceback
    assert main([*argv, "--max_steps", "2", "--resume_from_checkpoint", str(checkpoint)]) == 2
    err = capsys.readouterr().err
    errors = _error_lines(err)
    assert len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].startswith(
        f"opefo-train: error: The weights of {checkpoint} hold NaN or inf (1 tensor(s): model.embed_tokens.weight): "
    )
    assert errors[0].endswith(
        "Resume from an earlier checkpoint of the run (--resume_from_checkpoint <its folder>), whose weights are "
        "finite, perhaps with a lower learning_rate."
    )
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"]
