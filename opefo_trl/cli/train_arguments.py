"""The options of ``opefo-train`` besides ``OPEFOConfig`` and ``trl.ModelConfig``: TRL's ``ScriptArguments``
(``dataset_name``, ``dataset_config``, ``dataset_train_split``, ...) as TRL documents them, plus the data set's
columns, prompt template, reward functions, context-length check, output folder and metrics file
(:class:`TrainScriptArguments`), and the reward functions ``reward_funcs`` names (:func:`resolve_reward_funcs`: ours,
TRL's as ``trl grpo`` names them, or a dotted import path).
"""

import importlib
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from trl import ScriptArguments

from opefo_trl.data.reward_modes import (
    DEFAULT_MATH_REWARD_MODE,
    MathRewardMode,
    check_math_reward_mode,
    math_reward_mode_field,
)

DEFAULT_REWARD = "math_accuracy_reward"
#: TRL's reward functions by the names `trl grpo --reward_funcs` takes (TRL's scripts/grpo.py).
TRL_REWARDS = ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward", "get_soft_overlong_punishment")
#: What `trl grpo` builds `get_soft_overlong_punishment` with; opefo-train builds the same, so it needs this length.
TRL_OVERLONG_SETTINGS = dict(max_completion_len=1280, soft_punish_cache=256)


@dataclass
class TrainScriptArguments(ScriptArguments):
    """Data, prompt, reward and logging options of `opefo-train` (model options: `trl.ModelConfig`; training
    options: `opefo_trl.OPEFOConfig`). TRL's `ScriptArguments` keys mean what they mean in TRL's scripts;
    `dataset_streaming` and `ignore_bias_buffers` are refused when set (the prompts are checked whole before training;
    GRPO has no use for the DPO script's buffer fix).

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
    dataset_test_split: str = field(
        default="test",
        metadata={
            "help": "TRL's evaluation split. opefo-train trains without an evaluation set (eval_strategy must be "
            "'no'; evaluate checkpoints with opefo-eval), so this split is not read."
        },
    )
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
            "help": "Reward functions: 'math_accuracy_reward' (math-verify against the `solution` column), TRL's "
            "'accuracy_reward', 'reasoning_accuracy_reward', 'think_format_reward' and 'get_soft_overlong_punishment' "
            "(built as `trl grpo` builds it: max_completion_length 1280, cache 256), or dotted import paths "
            "('my_pkg.rewards.my_reward'). Each is called as TRL calls it, with the completions, "
            "`solution` and the data set's other columns as keyword arguments, each function its own copy. Weights: "
            "`reward_weights`."
        },
    )
    math_reward_mode: MathRewardMode = math_reward_mode_field()
    context_length: int | None = field(
        default=None,
        metadata={
            "help": "The model's context in tokens, which prompt + max_completion_length must fit; default: the "
            "model config's max_position_embeddings (4096 for Qwen2.5-Math-7B). With use_vllm, capped by "
            "vllm_max_model_length."
        },
    )
    context_length_beyond_model: bool = field(
        default=False,
        metadata={
            "help": "Allow a context_length above the model config's max_position_embeddings (e.g. a model whose "
            "position scaling its config does not state). Without it such a context_length is refused: the model "
            "was not trained on positions that far."
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
        check_math_reward_mode(self.math_reward_mode)
        if self.math_reward_mode != DEFAULT_MATH_REWARD_MODE and DEFAULT_REWARD not in self.reward_funcs:
            raise ValueError(
                f"math_reward_mode={self.math_reward_mode!r} sets how {DEFAULT_REWARD!r} scores, but reward_funcs "
                f"({self.reward_funcs}) does not name it; add {DEFAULT_REWARD!r} to reward_funcs or leave "
                f"math_reward_mode at {DEFAULT_MATH_REWARD_MODE!r}."
            )
        if self.dataset_streaming:
            raise ValueError(
                "dataset_streaming=true: opefo-train reads the whole training set first, to check every prompt "
                "against the model's context (and to deduplicate and set probe prompts aside); set it to false."
            )
        if self.ignore_bias_buffers:
            raise ValueError(
                "ignore_bias_buffers=true is TRL's DDP fix for its DPO script; GRPO training does not use it: "
                "remove it."
            )


def resolve_reward_funcs(names: Sequence[str], math_reward_mode: str = DEFAULT_MATH_REWARD_MODE) -> list[Callable]:
    """Reward functions by name (ours, 'math_accuracy_reward', built in ``math_reward_mode``; TRL's,
    :data:`TRL_REWARDS`) or dotted import path; raises naming the one that fails.

    Example:
        >>> [f.__name__ for f in resolve_reward_funcs(["accuracy_reward", "think_format_reward"])]
        ['accuracy_reward', 'think_format_reward']
    """
    funcs = []
    for name in names:
        if name == DEFAULT_REWARD:
            from opefo_trl.data.rewards import build_math_accuracy_reward

            funcs.append(build_math_accuracy_reward(math_reward_mode))
            continue
        if name in TRL_REWARDS:
            import trl.rewards

            func = getattr(trl.rewards, name)
            funcs.append(func(**TRL_OVERLONG_SETTINGS) if name == "get_soft_overlong_punishment" else func)
            continue
        module_name, _, attr = name.rpartition(".")
        if not module_name:
            known = ", ".join(repr(n) for n in (DEFAULT_REWARD, *TRL_REWARDS))
            raise ValueError(
                f"Unknown reward function {name!r}: use one of {known} or a dotted import path such as "
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
