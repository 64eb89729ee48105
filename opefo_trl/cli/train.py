"""`opefo-train`: train a math reasoner with OPEFO or one of the baselines of the paper's comparison.

Options come from a recipe YAML (`--config recipe.yaml`) and the command line, which overrides the recipe. They
are the fields of three dataclasses, all listed by `--help`:

- `TrainScriptArguments` (this module): data set, prompt template, reward functions, context-length check, metrics
  file;
- `trl.ModelConfig`: model path or hub id, dtype, attention implementation, LoRA / quantisation;
- `opefo_trl.OPEFOConfig`: every `GRPOConfig` / `TrainingArguments` option plus `method` and its settings.

Parsing is shared with `opefo-eval` (`opefo_trl.cli.options`): a misspelt or unknown key, in the recipe or on the
command line, is an error that names it and the closest options. Everything that can be checked without the model's
weights is checked before they are loaded: the options (types of recipe values included), the model path, the data
files and columns, the reward functions, the output_dir (see below), every file of the checkpoint to resume from,
that every prompt plus `max_completion_length` fits the model's context, that the run trains at least one step, and
that a resume has steps left and keeps the options its checkpoint would override (`opefo_trl.runs.options`). Such
errors, a reward function that fails at its first call, and a checkpoint that cannot be written (a full disk) are
printed as `opefo-train: error: ...` with exit status 2.

The output_dir is the run's own (`opefo_trl.runs`): one run at a time holds it (a second is refused at once, naming
the first's pid and host); the run records every top-level entry it writes in `opefo_run_manifest.json`, and
refuses a folder holding files no run of ours wrote (the model's own folder among them). An earlier run in it is
refused unless resumed or `--overwrite_output_dir true`, which sets the earlier run's entries aside and deletes them
only once the new run has saved its first checkpoint or final model (they are moved back if it fails before).

Examples:
    opefo-train --config recipes/qwen2.5-math-7b/opefo.yaml
    accelerate launch --config_file recipes/accelerate/zero3.yaml -m opefo_trl.cli.train \\
        --config recipes/qwen2.5-math-7b/opefo.yaml --output_dir runs/opefo-7b
    opefo-train --config recipes/qwen2.5-math-7b/opefo.yaml --resume_from_checkpoint true   # last checkpoint

    >>> from opefo_trl.cli.train import main
    >>> main(["--config", "recipes/qwen2.5-math-7b/opefo.yaml", "--max_steps", "10"])  # doctest: +SKIP
"""

import importlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from opefo_trl.cli.options import INPUT_ERRORS, build_parser, parse_options, report_error
from opefo_trl.runs import CheckpointSaveError, RunFolderError
from opefo_trl.trainer.checks import RewardFunctionError

logger = logging.getLogger("opefo_trl.cli.train")  # not __name__: "__main__" under `python -m`

DEFAULT_REWARD = "math_accuracy_reward"
PROG = "opefo-train"


@dataclass
class TrainScriptArguments:
    """Data, prompt, reward and logging options of `opefo-train` (model options: `trl.ModelConfig`; training
    options: `opefo_trl.OPEFOConfig`).

    Example:
        >>> TrainScriptArguments(dataset_name="gsm8k", prompt_template="qwen_math_boxed").reward_funcs
        ['math_accuracy_reward']
    """

    dataset_name: str = field(
        default="dapo-math-17k",
        metadata={
            "help": "Training data: a preset (dapo-math-17k, dapo-math-17k-raw, math-lighteval, gsm8k), 'local' "
            "(read `dataset_files`), or any hub id / local data set directory (then set problem_column and "
            "answer_column)."
        },
    )
    dataset_config: str | None = field(
        default=None,
        metadata={"help": "Hub configuration of the data set; default: the preset's (e.g. 'en', 'main')."},
    )
    dataset_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_files: list[str] | None = field(
        default=None,
        metadata={
            "help": "Local JSON / JSONL / Parquet / CSV files read instead of downloading `dataset_name`; with a "
            "preset they must have the preset's columns (offline runs, local copies)."
        },
    )
    problem_column: str | None = field(
        default=None,
        metadata={
            "help": "Column with the problem (text, or a chat whose last user turn is the problem); default: the "
            "preset's. Required for non-preset data."
        },
    )
    answer_column: str | None = field(
        default=None,
        metadata={
            "help": "Column with the gold answer; dotted names address struct fields (reward_model.ground_truth); "
            "default: the preset's. Required for non-preset data."
        },
    )
    answer_format: str | None = field(
        default=None,
        metadata={
            "help": "How the answer column stores the gold answer: 'plain', 'boxed' (last \\boxed{} of a "
            "solution) or 'gsm8k' (after '####'); default: the preset's, else 'plain'."
        },
    )
    deduplicate: bool | None = field(
        default=None,
        metadata={"help": "Keep one row per distinct problem; default: the preset's (on for dapo-math-17k-raw)."},
    )
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Train on the first N problems only (after deduplication)."}
    )
    probe_prompts: int = field(
        default=0,
        metadata={
            "help": "Set the last N problems of the training data aside (after deduplication and max_train_samples) "
            "as the 'param' flow's fixed probe: never trained on, their completions sampled once at the start, their "
            "entropy measured and balanced with each batch's (OPEFOTrainer's probe_dataset). Needs "
            "entropy_flow_estimate='param'. 0: none."
        },
    )
    prompt_template: str = field(
        default="qwen_math_boxed",
        metadata={"help": "Prompt template of opefo_trl.data.prompts: 'qwen_math_boxed', 'dapo' or 'plain'."},
    )
    reward_funcs: list[str] = field(
        default_factory=lambda: [DEFAULT_REWARD],
        metadata={
            "help": "Reward functions: 'math_accuracy_reward' (math-verify against the `solution` column) or "
            "dotted import paths ('my_pkg.rewards.my_reward'). Each is called as TRL calls it, with the completions, "
            "`solution` and the data set's other columns as keyword arguments, each function its own copy. Weights: "
            "`reward_weights`."
        },
    )
    context_length: int | None = field(
        default=None,
        metadata={
            "help": "The model's context in tokens, which prompt + max_completion_length must fit; default: the "
            "model config's max_position_embeddings (4096 for Qwen2.5-Math-7B). With use_vllm, capped by "
            "vllm_max_model_length."
        },
    )
    drop_overlong_prompts: bool = field(
        default=False,
        metadata={
            "help": "Drop prompts too long for context_length - max_completion_length (with a warning) instead "
            "of stopping with an error."
        },
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Start afresh in an output_dir that holds an earlier run of opefo-train: the files its manifest "
            "lists (nothing else) are set aside, deleted once the new run has saved its first checkpoint or final "
            "model, and moved back if it fails before that. Without it, such an output_dir is refused unless "
            "resume_from_checkpoint resumes a checkpoint in it."
        },
    )
    metrics_jsonl: Literal["main_process", "every_process", "off"] = field(
        default="main_process",
        metadata={
            "help": "Append every logged metrics dict as a JSON line to <output_dir>/metrics.jsonl (main_process), "
            "to <output_dir>/metrics.rank<N>.jsonl on every process (every_process: shows that distributed "
            "statistics such as entropy_flow/lambda agree across ranks), or nowhere (off). Independent of "
            "report_to."
        },
    )

    def __post_init__(self):
        # A recipe may give a single value where a list is expected (`reward_funcs: math_accuracy_reward`).
        if isinstance(self.reward_funcs, str):
            self.reward_funcs = [self.reward_funcs]
        if isinstance(self.dataset_files, str):
            self.dataset_files = [self.dataset_files]
        choices = ("main_process", "every_process", "off")
        if self.metrics_jsonl not in choices:
            raise ValueError(f"metrics_jsonl must be one of {choices}, got {self.metrics_jsonl!r}.")
        if self.max_train_samples is not None and self.max_train_samples < 1:
            raise ValueError(f"max_train_samples must be at least 1, got {self.max_train_samples}.")
        if self.probe_prompts < 0:
            raise ValueError(f"probe_prompts must be >= 0 (0: no probe), got {self.probe_prompts}.")
        if self.context_length is not None and self.context_length < 2:
            raise ValueError(f"context_length must be a positive number of tokens, got {self.context_length}.")
        if not self.reward_funcs:
            raise ValueError(f"reward_funcs is empty: give at least one, e.g. {DEFAULT_REWARD!r}.")


def make_parser():
    """The parser over (`TrainScriptArguments`, `OPEFOConfig`, `ModelConfig`): see `opefo_trl.cli.options`."""
    from trl import ModelConfig

    from opefo_trl.methods import TOKEN_METHODS
    from opefo_trl.trainer.config import OPEFOConfig

    return build_parser(
        (TrainScriptArguments, OPEFOConfig, ModelConfig),
        prog=PROG,
        description=(
            f"Train a math reasoner with OPEFO or a baseline (method: {', '.join(TOKEN_METHODS)}). "
            "Options come from a recipe YAML given with `--config recipe.yaml` (keys are the option names below, "
            "plus an optional `env:` mapping of environment variables) and from the command line, which overrides "
            "the recipe. Unknown keys are errors."
        ),
        epilog="Recipes for the OPEFO paper's comparison: recipes/README.md.",
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


def resolve_reward_funcs(names: Sequence[str]) -> list[Callable]:
    """Reward functions by name ('math_accuracy_reward') or dotted import path; raises naming the one that fails."""
    funcs = []
    for name in names:
        if name == DEFAULT_REWARD:
            from opefo_trl.data.rewards import math_accuracy_reward

            funcs.append(math_accuracy_reward)
            continue
        module_name, _, attr = name.rpartition(".")
        if not module_name:
            raise ValueError(
                f"Unknown reward function {name!r}: use {DEFAULT_REWARD!r} or a dotted import path such as "
                "'my_pkg.rewards.my_reward'."
            )
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise ValueError(f"Cannot import module {module_name!r} of reward function {name!r}: {err}") from err
        func = getattr(module, attr, None)
        if not callable(func):
            raise ValueError(f"Module {module_name!r} has no callable {attr!r} (reward function {name!r}).")
        funcs.append(func)
    return funcs


def validate_args(script_args, training_args, model_args) -> None:
    """Cross-option checks that need no model weights (TRL / OPEFOConfig check their own fields on construction)."""
    from opefo_trl.data.loading import check_datasets_cache, local_file_builder, resolve_dataset_source
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
    if script_args.dataset_files:
        local_file_builder(script_args.dataset_files)
    elif script_args.dataset_name == "local":
        raise ValueError("dataset_name 'local' needs dataset_files: the local JSON / JSONL / Parquet / CSV files.")
    get_template(script_args.prompt_template)
    resolve_reward_funcs(script_args.reward_funcs)
    if training_args.reward_weights is not None and len(training_args.reward_weights) != len(script_args.reward_funcs):
        raise ValueError(
            f"reward_weights has {len(training_args.reward_weights)} entries but reward_funcs has "
            f"{len(script_args.reward_funcs)} ({script_args.reward_funcs}); give one weight per reward function."
        )
    validate_output_dir(script_args, training_args, model_args.model_name_or_path)
    if model_args.use_peft:
        try:
            import peft  # noqa: F401
        except ImportError as err:
            raise ImportError("use_peft=true needs PEFT: `pip install 'opefo-trl[peft]'`.") from err


def _inside(path: str, folder: str) -> bool:
    return os.path.realpath(os.path.dirname(os.path.normpath(path))) == os.path.realpath(folder)


def _within(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(os.path.expanduser(path)), os.path.realpath(folder)
    return path == folder or path.startswith(folder + os.sep)


def _writes_output_dir(training_args) -> bool:
    """Whether this process writes the run folder (Trainer's `should_save`), read from the launcher's environment:
    the distributed state does not exist yet."""
    return os.environ.get("LOCAL_RANK" if training_args.save_on_each_node else "RANK", "0") == "0"


def _shown(names: Sequence[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def validate_output_dir(script_args, training_args, model_name_or_path: str | None = None, *, locked=False) -> None:
    """Refuse an output_dir this run cannot own, and a checkpoint to resume from that could not be loaded.

    Refused: a folder another run holds (its lock), the model's own folder, a folder holding files no run of ours
    wrote (`opefo_trl.runs.foreign_entries`), an earlier run (`opefo_trl.runs.run_files`) unless this run resumes a
    checkpoint in it or `overwrite_output_dir` (carried out by `RunFolder`), an overwrite that would delete the model
    or checkpoint this run starts from, and a metrics file the resumed run would append to whose lines before the
    last are not whole. What a killed run left half done (an overwrite, the final model's move) is finished or undone
    first, holding the lock. On the processes that do not write the folder, only the checkpoint is checked.
    ``locked``: the caller holds the folder's lock (:func:`train`, checking again).
    """
    from opefo_trl.runs import (
        RunFolderBusy,
        RunLock,
        busy_message,
        check_checkpoint,
        foreign_entries,
        interrupted_run,
        lock_holder,
        metrics_files,
        read_metrics_lines,
        recover_interrupted_run,
        resume_checkpoint,
        run_files,
    )

    output_dir, resume = training_args.output_dir, training_args.resume_from_checkpoint
    if os.path.islink(output_dir) and not os.path.exists(output_dir):
        raise ValueError(
            f"output_dir {output_dir!r} is a symbolic link to {os.readlink(output_dir)!r}, which does not exist; "
            "create that folder, or give another --output_dir."
        )
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ValueError(f"output_dir {output_dir!r} is a file; give a directory (it is created if missing).")
    writer = _writes_output_dir(training_args)
    if writer and not locked and os.path.isdir(output_dir):
        holder = lock_holder(output_dir)
        if holder is not None:
            raise RunFolderBusy(busy_message(output_dir, holder))
        if interrupted_run(output_dir):
            with RunLock(output_dir):
                restored = recover_interrupted_run(output_dir)
            if restored:
                logger.warning(
                    "A run into %s that overwrote it was stopped before it saved anything: the earlier run's %s are "
                    "back in place.",
                    output_dir,
                    ", ".join(restored),
                )
    if model_name_or_path and os.path.isdir(os.path.expanduser(model_name_or_path)):
        if os.path.realpath(os.path.expanduser(model_name_or_path)) == os.path.realpath(output_dir):
            raise ValueError(
                f"output_dir {output_dir!r} is the folder of the model this run starts from (model_name_or_path): "
                "its checkpoints and final model would be written over the model's own files. Give another "
                "--output_dir."
            )
    if resume is not None and resume is not True and not os.path.isdir(resume):
        raise FileNotFoundError(
            f"resume_from_checkpoint {resume!r} is not a directory. Give a checkpoint-<step> folder, or `true` for "
            f"the last checkpoint in output_dir ({output_dir!r})."
        )
    if resume is True:  # the last whole checkpoint (the trainer says which incomplete ones it skips)
        resume = resume_checkpoint(True, output_dir, training_args.method, warn=False)
    resumes_here = resume is not None and _inside(resume, output_dir)
    if script_args.overwrite_output_dir and resumes_here:
        raise ValueError(
            f"overwrite_output_dir would delete the checkpoint {resume} this run resumes from; drop one of the two."
        )
    if writer:
        foreign = foreign_entries(output_dir)
        if foreign:
            raise ValueError(
                f"output_dir {output_dir!r} holds files that no run of opefo-train wrote (its opefo_run_manifest.json "
                f"does not list them): {_shown(foreign)}. opefo-train writes over and deletes only what its own runs "
                "wrote: move them out of the folder, or give another --output_dir."
            )
        earlier = run_files(output_dir)
        if earlier and not resumes_here and not script_args.overwrite_output_dir:
            raise ValueError(
                f"output_dir {output_dir!r} holds an earlier run ({_shown(earlier)}); training into it would mix the "
                "two runs. Resume it with --resume_from_checkpoint true, start afresh in it with "
                "--overwrite_output_dir true (deletes those files once the new run has saved its first checkpoint), "
                "or give another --output_dir."
            )
        starts_from = [p for p in (model_name_or_path, resume) if p and os.path.isdir(os.path.expanduser(p))]
        if script_args.overwrite_output_dir:
            for name in earlier:
                for path in starts_from:
                    if _within(path, os.path.join(output_dir, name)):
                        raise ValueError(
                            f"overwrite_output_dir would delete {os.path.join(output_dir, name)}, which holds {path}, "
                            "the model this run starts from; copy it elsewhere first, or give another --output_dir."
                        )
        if resumes_here:
            for path in metrics_files(output_dir):
                read_metrics_lines(path)  # a cut-off last line is dropped when training starts; a corrupt one is not
    if resume is not None and training_args.resume_from_checkpoint is not True:  # `true`: checked when chosen
        check_checkpoint(resume, method=training_args.method)


def context_length_for(script_args, training_args, model_args) -> int:
    """The context prompts must fit: `context_length`, else the model's max_position_embeddings; capped by vLLM's."""
    from opefo_trl.data.model_files import model_context_length

    context = model_context_length(
        model_args.model_name_or_path,
        context_length=script_args.context_length,
        max_model_len=training_args.vllm_max_model_length if training_args.use_vllm else None,
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
    )
    if context is None:
        raise ValueError(
            f"The config of {model_args.model_name_or_path!r} has no max_position_embeddings; set context_length "
            "to the model's context in tokens."
        )
    return context


def build_train_dataset(script_args, training_args, model_args, tokenizer):
    """Load the data set, render its prompts and check them against the context; before any model weights load."""
    from opefo_trl.data.loading import check_prompt_lengths, load_math_dataset

    dataset = load_math_dataset(
        script_args.dataset_name,
        template=script_args.prompt_template,
        split=script_args.dataset_split,
        config=script_args.dataset_config,
        data_files=script_args.dataset_files,
        problem_column=script_args.problem_column,
        answer_column=script_args.answer_column,
        answer_format=script_args.answer_format,
        deduplicate=script_args.deduplicate,
        max_samples=script_args.max_train_samples,
    )
    context = context_length_for(script_args, training_args, model_args)
    dataset = check_prompt_lengths(
        dataset,
        tokenizer,
        max_completion_length=training_args.max_completion_length,
        max_position_embeddings=context,
        drop_overlong=script_args.drop_overlong_prompts,
        chat_template_kwargs=training_args.chat_template_kwargs,
    )
    if script_args.probe_prompts:
        from opefo_trl.methods import get_token_method_class
        from opefo_trl.trainer.probe import check_probe_dataset

        if script_args.probe_prompts >= len(dataset):
            raise ValueError(
                f"probe_prompts={script_args.probe_prompts} would set aside every one of the {len(dataset)} problems; "
                "give fewer, or more data."
            )
        method = get_token_method_class(training_args.method)
        check_probe_dataset(
            split_probe(dataset, script_args.probe_prompts)[1], training_args, method.needs_rollout_pass
        )
    check_run_length(len(dataset) - script_args.probe_prompts, training_args)
    logger.info(
        "Training data: %d problems from %s (template %r); every prompt + %d completion tokens fits the context of %d.",
        len(dataset),
        script_args.dataset_name,
        script_args.prompt_template,
        training_args.max_completion_length,
        context,
    )
    return dataset


def check_run_length(num_prompts: int, training_args) -> None:
    """Refuse a run that would train no step, or resume a checkpoint at or past its last step or with options it
    would override (`opefo_trl.runs.options`)."""
    from opefo_trl.runs import check_resume_options, check_steps_left, resume_checkpoint
    from opefo_trl.trainer.checks import check_trains_some_steps

    steps = check_trains_some_steps(num_prompts, training_args)
    resume = resume_checkpoint(
        training_args.resume_from_checkpoint, training_args.output_dir, training_args.method, warn=False
    )
    if resume is not None:
        check_steps_left(resume, steps)
        check_resume_options(resume, training_args)  # what it takes is said when training resumes


def split_probe(dataset, probe_prompts: int) -> tuple:
    """The training data without its last ``probe_prompts`` rows, and those rows (None when 0): the fixed probe."""
    if not probe_prompts:
        return dataset, None
    kept = len(dataset) - probe_prompts
    return dataset.select(range(kept)), dataset.select(range(kept, len(dataset)))


def prepare_inputs(script_args, training_args, model_args) -> tuple:
    """The checked training data and the reward functions: the last input checks, made before any weights load."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            model_args.model_name_or_path,
            revision=model_args.model_revision,
            trust_remote_code=training_args.trust_remote_code,
        )
    except OSError as err:  # not on the hub, not in the cache when offline, or a directory without a tokenizer
        raise FileNotFoundError(f"Cannot load the tokenizer of {model_args.model_name_or_path!r}: {err}") from err
    train_dataset = build_train_dataset(script_args, training_args, model_args, tokenizer)
    return train_dataset, resolve_reward_funcs(script_args.reward_funcs)


def _declared_names(script_args, training_args) -> list[str]:
    """What this run writes into output_dir besides its checkpoints and final model, named in its manifest before
    it exists: the metrics files, TensorBoard's default `runs/` folder, TRL's `completions/` and the model card."""
    from opefo_trl.runs import METRICS_FILE, METRICS_FILE_PER_RANK

    names = []
    if script_args.metrics_jsonl == "main_process":
        names.append(METRICS_FILE)
    elif script_args.metrics_jsonl == "every_process":
        names += [METRICS_FILE_PER_RANK.format(rank=r) for r in range(int(os.environ.get("WORLD_SIZE", "1")))]
    report_to = training_args.report_to or []
    if ("tensorboard" in report_to or "all" in report_to) and not os.environ.get("TENSORBOARD_LOGGING_DIR"):
        names.append("runs")
    if training_args.log_completions:
        names.append("completions")
    if training_args.push_to_hub:
        names.append("README.md")
    return names


def train(script_args, training_args, model_args, train_dataset=None, reward_funcs=None):
    """Build the data, rewards and `OPEFOTrainer` from parsed options, train (resuming if asked), save; return it.

    The process that writes output_dir holds it for the whole run (`opefo_trl.runs.RunFolder`: the lock, the
    manifest, the overwrite), and checks it again once it holds the lock. ``train_dataset`` and ``reward_funcs`` are
    what :func:`prepare_inputs` returns; they are built here if not given.
    """
    from opefo_trl.cli.options import INPUT_ERRORS
    from opefo_trl.runs import RunFolder

    if train_dataset is None or reward_funcs is None:
        train_dataset, reward_funcs = prepare_inputs(script_args, training_args, model_args)
    run = None
    if _writes_output_dir(training_args):
        run = RunFolder(
            training_args.output_dir,
            overwrite=script_args.overwrite_output_dir,
            declared=_declared_names(script_args, training_args),
        )
        model = model_args.model_name_or_path
        try:
            run.open(lambda: validate_output_dir(script_args, training_args, model, locked=True))
        except RunFolderError:
            raise
        except INPUT_ERRORS as err:  # the folder changed since it was checked
            raise RunFolderError(str(err)) from err
        if run.set_aside:
            logger.info(
                "overwrite_output_dir: the earlier run's %s are set aside in %s until this run saves its first "
                "checkpoint or its final model (moved back if it fails before).",
                ", ".join(run.set_aside),
                os.path.join(training_args.output_dir, ".opefo_overwritten"),
            )
    try:
        trainer = _train(script_args, training_args, model_args, train_dataset, reward_funcs, run)
    except BaseException:
        if run is not None:
            run.close(failed=True)
        raise
    if run is not None:
        run.close(failed=False)
    return trainer


def _train(script_args, training_args, model_args, train_dataset, reward_funcs, run):
    import transformers
    from packaging.version import Version
    from trl import get_peft_config, get_quantization_config

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
    if Version(transformers.__version__) >= Version("5.18.0"):
        trainer.end()
    return trainer


class _StderrHandler(logging.StreamHandler):
    """Writes to sys.stderr as it is when a message is logged: `main` may run again after stderr was replaced
    (a notebook cell, a test capturing output), and a handler keeping the old stream would write to a closed one."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def _show_package_logs() -> None:
    """Print opefo_trl's INFO messages (data set size, dropped rows) without touching other libraries' logging."""
    package_logger = logging.getLogger("opefo_trl")
    if not package_logger.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("[%(asctime)s] [opefo-train] %(message)s", "%H:%M:%S"))
        package_logger.addHandler(handler)
        # INFO on the main process only; warnings from every rank.
        main_process = os.environ.get("RANK", "0") == "0"
        package_logger.setLevel(logging.INFO if main_process else logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point of `opefo-train` (also `python -m opefo_trl.cli.train`); returns the exit status.

    Bad input (an option, recipe, data file or column, reward function, output_dir or checkpoint), found before the
    model weights load, is printed as `opefo-train: error: ...` with exit status 2, as opefo-eval reports it; so is a
    reward function that raises or returns non-numbers (found at its first call), an output_dir another run took
    meanwhile, and a checkpoint or final model that cannot be written (a full disk).
    """
    _show_package_logs()
    try:
        script_args, training_args, model_args = parse_args(argv)
        train_dataset, reward_funcs = prepare_inputs(script_args, training_args, model_args)
    except INPUT_ERRORS as err:
        return report_error(PROG, err)
    try:
        train(script_args, training_args, model_args, train_dataset, reward_funcs)
    except (RewardFunctionError, RunFolderError, CheckpointSaveError) as err:  # no traceback, as for bad input
        return report_error(PROG, err)
    return 0


if __name__ == "__main__":
    sys.exit(main())
