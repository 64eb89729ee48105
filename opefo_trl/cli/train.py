"""`opefo-train`: train a math reasoner with OPEFO or one of the baselines of the paper's comparison.

Options come from a recipe YAML (`--config recipe.yaml`) and the command line, which overrides the recipe. They
are the fields of three dataclasses, all listed by `--help`:

- `TrainScriptArguments` (`opefo_trl.cli.train_arguments`): TRL's `ScriptArguments` (`dataset_name`,
  `dataset_config`, `dataset_train_split`, ...), then the data's columns, prompt template, reward functions (ours,
  TRL's by `trl grpo`'s names, or dotted paths), context-length check, output folder, metrics file;
- `trl.ModelConfig`: model path or hub id, dtype, attention implementation, LoRA / quantisation;
- `opefo_trl.OPEFOConfig`: every `GRPOConfig` / `TrainingArguments` option plus `method` and its settings.

Parsing is shared with `opefo-eval` (`opefo_trl.cli.options`): a misspelt or unknown key, in the recipe or on the
command line, is an error that names it and the closest options. Everything that can be checked without the model's
weights is checked before they are loaded: the options (types of recipe values included), the model path, the data
files and columns, the reward functions, the output_dir (see below), every file of the checkpoint to resume from,
that every prompt plus `max_completion_length` fits the model's context, that the run trains at least one step, and
that a resume has steps left, keeps the options its checkpoint would override and the data and rewards it trained on
(`opefo_trl.runs.options`), and starts at a rollout boundary (`opefo_trl.runs.check_rollout_boundary`). Such
errors, weights holding NaN or inf (checked once loaded, before the first generation), a reward function that fails
at its first call, and a checkpoint that cannot be written (a full disk) are printed as `opefo-train: error: ...`
with exit status 2.

The output_dir is the run's own: one run at a time, nothing deleted that no run of ours wrote, an earlier run refused
unless resumed or overwritten (`--overwrite_output_dir true`); `opefo_trl.runs.policy` says what is refused and how an
overwrite keeps the earlier run until the new one has saved something.

Examples:
    opefo-train --config recipes/qwen2.5-math-7b/opefo.yaml
    accelerate launch --config_file recipes/accelerate/zero3.yaml -m opefo_trl.cli.train \\
        --config recipes/qwen2.5-math-7b/opefo.yaml --output_dir runs/opefo-7b
    opefo-train --config recipes/qwen2.5-math-7b/opefo.yaml --resume_from_checkpoint true   # last checkpoint

    >>> from opefo_trl.cli.train import main
    >>> main(["--config", "recipes/qwen2.5-math-7b/opefo.yaml", "--max_steps", "10"])  # doctest: +SKIP
"""

import atexit
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from opefo_trl.cli.options import INPUT_ERRORS, build_parser, parse_options, report_error, show_package_logs
from opefo_trl.cli.train_arguments import TRL_OVERLONG_SETTINGS, TrainScriptArguments, resolve_reward_funcs
from opefo_trl.runs import CheckpointSaveError, OutputDirPolicy, RunFolderError
from opefo_trl.trainer.checks import NonFiniteWeightsError, RewardFunctionError

logger = logging.getLogger("opefo_trl.cli.train")  # not __name__: "__main__" under `python -m`

PROG = "opefo-train"


def make_parser():
    """The parser over (`TrainScriptArguments`, `OPEFOConfig`, `ModelConfig`): see `opefo_trl.cli.options`. `--help`
    lists OPEFOConfig's own options first, then the data and reward options, the model's, and GRPOConfig's."""
    import dataclasses

    from trl import GRPOConfig, ModelConfig

    from opefo_trl.methods import TOKEN_METHODS
    from opefo_trl.trainer.config import OPEFOConfig

    def names(cls, without=()):
        return [f.name for f in dataclasses.fields(cls) if f.init and f.name not in without]

    grpo_options = set(names(GRPOConfig))
    return build_parser(
        (TrainScriptArguments, OPEFOConfig, ModelConfig),
        prog=PROG,
        description=(
            f"Train a math reasoner with OPEFO or a baseline (method: {', '.join(TOKEN_METHODS)}). "
            "Options come from a recipe YAML given with `--config recipe.yaml` (keys are the option names below, "
            "plus an optional `env:` mapping of environment variables and an optional `base:` recipe it builds on) "
            "and from the command line, which overrides the recipe. Unknown keys are errors."
        ),
        epilog="Recipes for the OPEFO paper's comparison: recipes/README.md.",
        groups=(
            (
                "OPEFO: the method and the entropy flow (OPEFOConfig's own options)",
                ["method", *names(OPEFOConfig, grpo_options | {"method"})],
            ),
            ("data, prompt and rewards (TRL's ScriptArguments and opefo-train's own)", names(TrainScriptArguments)),
            ("model (trl.ModelConfig)", names(ModelConfig)),
        ),
        other_options="training (GRPOConfig and transformers' TrainingArguments)",
        usage=f"{PROG} [--config RECIPE_YAML] [--OPTION VALUE ...]",
        renamed={"dataset_split": "dataset_train_split"},  # TRL's ScriptArguments name
    )


def _normalise_resume(value):
    """`resume_from_checkpoint`: a path, True (last checkpoint in output_dir) or None; 'true'/'false' accepted."""
    if isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in ("true", "yes", "1", "last"):
            return True
        if lowered in ("false", "no", "0", "none", "null", ""):
            return None
    if value is False:
        return None
    return value


def parse_args(argv: Sequence[str] | None = None):
    """Parse a recipe plus command-line overrides into (script_args, training_args, model_args) and validate them.

    Raises ValueError / FileNotFoundError with the offending key, file or value; loads no model weights.
    """
    script_args, training_args, model_args = parse_options(make_parser(), argv)
    training_args.resume_from_checkpoint = _normalise_resume(training_args.resume_from_checkpoint)
    validate_args(script_args, training_args, model_args)
    return script_args, training_args, model_args


def validate_args(script_args, training_args, model_args) -> None:
    """Cross-option checks that need no model weights (TRL / OPEFOConfig check their own fields on construction)."""
    from opefo_trl.data.loading import (
        check_config_for_files,
        check_datasets_cache,
        local_file_builder,
        resolve_dataset_source,
    )
    from opefo_trl.data.model_files import check_model_name_or_path
    from opefo_trl.data.prompts import get_template
    from opefo_trl.trainer.checks import check_training_values, non_finite_options

    if not model_args.model_name_or_path:
        raise ValueError("model_name_or_path is not set: give a hub id or a local model directory.")
    check_model_name_or_path(model_args.model_name_or_path)
    check_training_values(training_args)
    # The training options are checked with the trainer's own; the model and script options (e.g. lora_dropout) here.
    non_finite = non_finite_options(model_args) + non_finite_options(script_args)
    if non_finite:
        raise ValueError(f"{', '.join(non_finite)}: options must be finite numbers.")
    resolve_dataset_source(
        script_args.dataset_name,
        config=script_args.dataset_config,
        problem_column=script_args.problem_column,
        answer_column=script_args.answer_column,
        answer_format=script_args.answer_format,
        deduplicate=script_args.deduplicate,
    )
    check_datasets_cache()
    check_config_for_files(script_args.dataset_config, script_args.dataset_files)
    if script_args.dataset_files:
        local_file_builder(script_args.dataset_files)
    elif script_args.dataset_name == "local":
        raise ValueError("dataset_name 'local' needs dataset_files: the local JSON / JSONL / Parquet / CSV files.")
    get_template(script_args.prompt_template)
    if training_args.eval_strategy != "no":
        strategy = getattr(training_args.eval_strategy, "value", training_args.eval_strategy)  # TRL's enum, or text
        raise ValueError(
            f"eval_strategy={strategy!r}: opefo-train trains without an evaluation set "
            "(dataset_test_split is not read); set eval_strategy to 'no' and evaluate checkpoints with opefo-eval."
        )
    resolve_reward_funcs(script_args.reward_funcs, script_args.math_reward_mode)
    overlong = TRL_OVERLONG_SETTINGS["max_completion_len"]
    if "get_soft_overlong_punishment" in script_args.reward_funcs and training_args.max_completion_length != overlong:
        raise ValueError(
            f"reward 'get_soft_overlong_punishment' is built as `trl grpo` builds it, for max_completion_length="
            f"{overlong}, not {training_args.max_completion_length}; for another length name your own: a module "
            "with `overlong = trl.rewards.get_soft_overlong_punishment(max_completion_len=..., soft_punish_cache=...)`"
            " and `--reward_funcs my_module.overlong`."
        )
    if training_args.reward_weights is not None and len(training_args.reward_weights) != len(script_args.reward_funcs):
        raise ValueError(
            f"reward_weights has {len(training_args.reward_weights)} entries but reward_funcs has "
            f"{len(script_args.reward_funcs)} ({script_args.reward_funcs}); give one weight per reward function."
        )
    output_dir_policy(script_args, training_args, model_args).check()
    if model_args.use_peft:
        try:
            import peft  # noqa: F401
        except ImportError as err:
            raise ImportError("use_peft=true needs PEFT: `pip install 'opefo-trl[peft]'`.") from err


def output_dir_policy(script_args, training_args, model_args) -> OutputDirPolicy:
    """What this run may do with its output_dir (`opefo_trl.runs.policy`)."""
    return OutputDirPolicy(
        training_args,
        model_name_or_path=model_args.model_name_or_path,
        overwrite=script_args.overwrite_output_dir,
        metrics_jsonl=script_args.metrics_jsonl,
    )


def run_inputs(script_args) -> dict:
    """What the run trains on, recorded in each checkpoint and refused on resume when it differs
    (`opefo_trl.runs.training_inputs`): its data (local files by SHA-256, else the data set's name, config and split),
    prompt template and reward functions (with math_reward_mode)."""
    from opefo_trl.data.loading import resolve_dataset_source
    from opefo_trl.runs import training_inputs

    source = resolve_dataset_source(
        script_args.dataset_name,
        config=script_args.dataset_config,
        problem_column=script_args.problem_column,
        answer_column=script_args.answer_column,
    )
    return training_inputs(
        script_args.dataset_name,
        source.config,
        script_args.dataset_train_split,
        script_args.dataset_files,
        script_args.reward_funcs,
        script_args.math_reward_mode,
        script_args.prompt_template,
    )


def check_context_length(script_args, training_args, model_args) -> None:
    """Refuse a ``context_length`` above the model's ``max_position_embeddings`` unless the user says so
    (``context_length_beyond_model``): prompts that long would reach positions the model was never trained on."""
    from opefo_trl.data.model_files import model_context_length

    if script_args.context_length is None or script_args.context_length_beyond_model:
        return
    try:
        model_positions = model_context_length(
            model_args.model_name_or_path,
            revision=model_args.model_revision,
            trust_remote_code=training_args.trust_remote_code,
        )
    except OSError:  # no readable config here: loading the model reports it
        return
    if model_positions is not None and script_args.context_length > model_positions:
        raise ValueError(
            f"context_length={script_args.context_length} is above the {model_positions} positions of "
            f"{model_args.model_name_or_path!r} (its config's max_position_embeddings): prompt and completion tokens "
            f"past position {model_positions} would go where the model was never trained. Give context_length <= "
            f"{model_positions}, or add --context_length_beyond_model true if the model does handle longer contexts."
        )


def prepare_inputs(script_args, training_args, model_args) -> tuple:
    """The checked training data and the reward functions: the last input checks, made before any weights load (the
    prompts against the context, the probe, that the run trains a step, what a resume would train, and what this
    machine cannot run with vLLM)."""
    from trl import get_peft_config

    from opefo_trl.data.train_dataset import load_tokenizer, load_train_dataset, split_probe
    from opefo_trl.experimental.fixed_probe import check_probe_dataset
    from opefo_trl.methods import get_token_method_class
    from opefo_trl.trainer.checks import (
        check_dropout,
        check_save_steps,
        check_trains_some_steps,
        check_vllm_setup,
        steps_per_epoch,
    )

    check_context_length(script_args, training_args, model_args)
    tokenizer = load_tokenizer(model_args, training_args)
    dataset, context = load_train_dataset(script_args, training_args, model_args, tokenizer)
    if script_args.probe_prompts:
        needs_rollout_pass = get_token_method_class(training_args.method).needs_rollout_pass
        check_probe_dataset(split_probe(dataset, script_args.probe_prompts)[1], training_args, needs_rollout_pass)
    num_prompts = len(dataset) - script_args.probe_prompts
    steps = check_trains_some_steps(num_prompts, training_args)
    check_save_steps(training_args, steps_per_epoch(num_prompts, training_args))
    output_dir_policy(script_args, training_args, model_args).check_resume(
        steps, run_inputs(script_args), steps_per_epoch(num_prompts, training_args)
    )
    # What the machine at hand cannot run with vLLM, and dropout in training (the trainer checks them again, too late
    # for one line).
    check_vllm_setup(training_args, model_args.model_name_or_path)
    check_dropout(training_args, model_args.model_name_or_path, get_peft_config(model_args))
    logger.info(
        "Training data: %d problems from %s (template %r); every prompt + %d completion tokens fits the context of %d.",
        len(dataset),
        script_args.dataset_name,
        script_args.prompt_template,
        training_args.max_completion_length,
        context,
    )
    return dataset, resolve_reward_funcs(script_args.reward_funcs, script_args.math_reward_mode)


def train(script_args, training_args, model_args, train_dataset=None, reward_funcs=None):
    """Build the data, rewards and `OPEFOTrainer` from parsed options, train (resuming if asked), save; return it.

    The process that writes output_dir holds it for the whole run (`OutputDirPolicy.held`: the lock, the manifest,
    the overwrite), and checks it again once it holds the lock. ``train_dataset`` and ``reward_funcs`` are what
    :func:`prepare_inputs` returns; they are built here if not given.
    """
    if train_dataset is None or reward_funcs is None:
        train_dataset, reward_funcs = prepare_inputs(script_args, training_args, model_args)
    with output_dir_policy(script_args, training_args, model_args).held() as run:
        return _train(script_args, training_args, model_args, train_dataset, reward_funcs, run)


def _train(script_args, training_args, model_args, train_dataset, reward_funcs, run):
    import transformers
    from packaging.version import Version
    from trl import get_peft_config, get_quantization_config

    from opefo_trl.data.train_dataset import split_probe
    from opefo_trl.runs import FINAL_MODEL_STAGING, reported_write_errors
    from opefo_trl.trainer import OPEFOTrainer
    from opefo_trl.trainer.callbacks import MetricsJsonlCallback, RunFolderCallback

    model_init_kwargs = dict(
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
    )
    model_init_kwargs.update(training_args.model_init_kwargs or {})
    training_args.model_init_kwargs = model_init_kwargs
    callbacks = [] if run is None else [RunFolderCallback(run)]
    if script_args.metrics_jsonl != "off":
        callbacks.append(MetricsJsonlCallback(training_args.output_dir, script_args.metrics_jsonl))

    train_dataset, probe_dataset = split_probe(train_dataset, script_args.probe_prompts)
    trainer = OPEFOTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train_dataset,
        callbacks=callbacks or None,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
        probe_dataset=probe_dataset,
        run_inputs=run_inputs(script_args),
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    # Saved aside, then moved into output_dir file by file, each named in the manifest first.
    staging = os.path.join(training_args.output_dir, FINAL_MODEL_STAGING)
    with reported_write_errors(staging, "final model", writer=run is not None):
        trainer.save_model(staging)
    trainer.accelerator.wait_for_everyone()
    if run is not None:
        run.publish_final_model(staging)
    # The processes leave together: one that tears its process group down while another still works has been seen
    # to abort (SIGABRT in gloo) after a successful run.
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    # Not under DeepSpeed, whose engine keeps process groups of its own: tearing the default group down here made a
    # rank abort at exit (SIGABRT, "terminate called without an active exception") in 2 of 4 two-process ZeRO-3 runs on
    # a loaded CPU, and in none of 5 without it; DeepSpeed's own exit tears its groups down.
    if Version(transformers.__version__) >= Version("5.18.0") and not trainer.is_deepspeed_enabled:
        trainer.end()
    return trainer


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point of `opefo-train` (also `python -m opefo_trl.cli.train`); returns the exit status.

    Bad input (an option, recipe, data file or column, reward function, output_dir or checkpoint), found before the
    model weights load, is printed as `opefo-train: error: ...` with exit status 2, as opefo-eval reports it; so is a
    reward function that raises or returns non-numbers (found at its first call), weights holding NaN or inf (found
    before the first generation), an output_dir another run took meanwhile, and a checkpoint or final model that
    cannot be written (a full disk).
    """
    show_package_logs(PROG)
    try:
        script_args, training_args, model_args = parse_args(argv)
        train_dataset, reward_funcs = prepare_inputs(script_args, training_args, model_args)
    except INPUT_ERRORS as err:
        return report_error(PROG, err)
    try:
        trainer = train(script_args, training_args, model_args, train_dataset, reward_funcs)
    # No traceback, as for bad input.
    except (RewardFunctionError, NonFiniteWeightsError, RunFolderError, CheckpointSaveError) as err:
        return report_error(PROG, err)
    if trainer.accelerator.num_processes > 1 and trainer.accelerator.state.backend == "gloo":
        exit_before_finalization(0)
    return 0


def exit_before_finalization(status: int) -> NoReturn:
    """Ends the process with `status` once its atexit handlers (trackers, temporary files) and logging have run,
    without the interpreter's finalization.

    Why, for a multi-process run on gloo (CPU): a gloo worker thread can still be destroying a finished collective
    when the main thread returns (the last barrier holds the all-gathers before it), and that needs the GIL for the
    tensors' Python objects. Once Python is finalizing, the thread is unwound through a noexcept destructor and the
    rank aborts with SIGABRT ("terminate called without an active exception") after a successful run: seen in 1 of 58
    loaded two-process runs; core dump: ~AsyncBarrierWork -> ~AsyncAllgatherWork -> decref_pyobject -> pthread_exit.
    `destroy_process_group()` does not stop those threads while DDP's or DeepSpeed's engine holds the group (torch
    2.13; pytorch/pytorch#190489).
    """
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
