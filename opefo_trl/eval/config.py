"""Options of :func:`opefo_trl.eval.evaluate` and ``opefo-eval`` (one dataclass: every field is a flag)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

from opefo_trl.data.prompts import DEFAULT_TEMPLATE, PROMPT_TEMPLATES, get_template
from opefo_trl.data.reward_modes import (
    DEFAULT_MATH_REWARD_MODE,
    MATH_REWARD_MODE_HELP,
    MathRewardMode,
    check_math_reward_mode,
)
from opefo_trl.runs.files import RUN_OPTIONS_NAME
from opefo_trl.runs.options import read_run_options

from .benchmarks import BENCHMARKS, PAPER_BENCHMARKS, parse_benchmark_files

BACKENDS = ("auto", "vllm", "transformers")
#: Where a default comes from when the option is not given: the run's recorded options, else these.
TRAINED_WITH = {"prompt_template": DEFAULT_TEMPLATE, "math_reward_mode": DEFAULT_MATH_REWARD_MODE}
_FROM_THE_RUN = (
    "the one the run was trained with, recorded in the model folder's opefo_run_options.json by opefo-train; else"
)


def check_device(device: str) -> None:
    """Refuse a ``device`` torch cannot parse, or one this machine does not have (a CUDA or MPS device without one).

    >>> check_device("tpu9")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: device='tpu9' is not a torch device (...); give cpu, cuda, cuda:<index> or mps, or leave it unset ...
    """
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError as err:
        raise ValueError(
            f"device={device!r} is not a torch device ({str(err).splitlines()[0]}); give cpu, cuda, cuda:<index> or "
            "mps, or leave it unset (cuda if found, else cpu)."
        ) from None
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(
                f"device={device!r} but this machine has no CUDA GPU that torch can use (torch.cuda.is_available() is "
                "False); give --device cpu, or leave it unset."
            )
        if parsed.index is not None and parsed.index >= count:
            raise ValueError(
                f"device={device!r} but this machine has {count} CUDA GPU(s) (cuda:0 to cuda:{count - 1}); give one "
                "of those, or leave it unset."
            )
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device={device!r} but MPS is not available on this machine; give --device cpu.")


@dataclass
class EvaluationConfig:
    """Options of :func:`evaluate` and ``opefo-eval`` (every field is a ``--flag``; ``--config eval.yaml`` works too).

    Example:
        >>> EvaluationConfig(model_name_or_path="Qwen/Qwen2.5-Math-7B", benchmarks=["aime24"]).temperature
        1.0
    """

    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Model to evaluate: a local checkpoint directory, a hub id, or a PEFT LoRA adapter directory "
            "(detected by its adapter_config.json; the base model is loaded and the adapter applied)."
        },
    )
    base_model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Base model of a LoRA adapter; default: `base_model_name_or_path` of adapter_config.json."},
    )
    benchmarks: list[str] = field(
        default_factory=lambda: list(PAPER_BENCHMARKS),
        metadata={
            "help": f"Benchmarks: registered names ({', '.join(BENCHMARKS)}) and/or local .json/.jsonl/.parquet/.csv "
            "files (read with `question_column` / `answer_column`; named after the file)."
        },
    )
    benchmark_files: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Local copies of registered benchmarks as NAME=PATH (same columns as the hub data set), e.g. "
            "aime24=/data/aime_2024.parquet, for offline machines."
        },
    )
    question_column: str = field(default="problem", metadata={"help": "Problem column of local benchmark files."})
    answer_column: str = field(default="answer", metadata={"help": "Gold-answer column of local benchmark files."})
    num_samples: int | None = field(
        default=None,
        metadata={
            "help": "Samples per problem (n) for every benchmark; default: the paper's protocol (32 on aime24, "
            "aime25, amc23; 1 elsewhere and on local files)."
        },
    )
    pass_at_k: list[int] | None = field(
        default=None,
        metadata={
            "help": "k values of pass@k; each must be <= n of every benchmark (checked before generation). "
            "Default: 1, 2, 4, ... up to n per benchmark."
        },
    )
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (0 = greedy)."})
    top_p: float = field(default=0.7, metadata={"help": "Nucleus sampling top-p (paper: 0.7)."})
    max_new_tokens: int = field(default=3000, metadata={"help": "Maximum tokens generated per sample."})
    prompt_template: str | None = field(
        default=None,
        metadata={
            "help": f"Prompt template of opefo_trl.data.prompts: {', '.join(PROMPT_TEMPLATES)}. Default: "
            f"{_FROM_THE_RUN} {DEFAULT_TEMPLATE!r}."
        },
    )
    math_reward_mode: MathRewardMode | None = field(
        default=None,
        metadata={"help": f"{MATH_REWARD_MODE_HELP} Default: {_FROM_THE_RUN} {DEFAULT_MATH_REWARD_MODE!r}."},
    )
    seed: int = field(
        default=0,
        metadata={
            "help": "Base seed. Sample i of problem p of benchmark b is drawn with its own seed, a hash of (seed, b, "
            "p, i), whatever was stored before an interruption and whatever else shares its batch."
        },
    )
    backend: Literal["auto", "vllm", "transformers"] = field(
        default="auto",
        metadata={"help": "Generation backend: 'vllm', 'transformers', or 'auto' (vLLM if installed and on a GPU)."},
    )
    batch_size: int = field(
        default=64,
        metadata={"help": "transformers backend: sequences (prompts x samples) per generate call."},
    )
    vllm_problems_per_call: int = field(
        default=256,
        metadata={"help": "vLLM backend: problems per generate call; samples are saved after every call."},
    )
    vllm_gpu_memory_utilization: float = field(default=0.9, metadata={"help": "vLLM: GPU memory fraction."})
    vllm_tensor_parallel_size: int = field(default=1, metadata={"help": "vLLM: tensor-parallel GPUs."})
    max_model_len: int | None = field(
        default=None, metadata={"help": "vLLM: context length (prompt + completion); default: the model's."}
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = field(
        default="auto",
        metadata={"help": "Model dtype: 'auto' (bfloat16 on GPU, float32 on CPU), 'bfloat16', 'float16', 'float32'."},
    )
    device: str | None = field(default=None, metadata={"help": "transformers backend device; default: cuda if found."})
    max_problems: int | None = field(
        default=None, metadata={"help": "Evaluate only the first N problems of each benchmark (smoke tests)."}
    )
    output_dir: str = field(default="eval_results", metadata={"help": "Where samples and results are written."})
    overwrite: bool = field(
        default=False,
        metadata={"help": "Delete samples of an earlier run in output_dir instead of resuming from them."},
    )
    progress: bool = field(default=True, metadata={"help": "Show a progress bar."})
    #: Which prompt template and reward mode are used, and where each comes from (set on construction; not a flag).
    prompt_and_reward_source: str = field(default="", init=False, compare=False)

    def __post_init__(self):
        if isinstance(self.benchmarks, str):
            self.benchmarks = [self.benchmarks]
        if isinstance(self.pass_at_k, int):
            self.pass_at_k = [self.pass_at_k]
        if not self.model_name_or_path:
            raise ValueError("model_name_or_path is required: a checkpoint directory, a hub id or a LoRA adapter.")
        if not self.benchmarks:
            raise ValueError(f"No benchmarks given; choose from {', '.join(BENCHMARKS)} or pass local files.")
        from opefo_trl.trainer.checks import non_finite_options, vllm_option_problems  # opefo-train's checks too

        non_finite = non_finite_options(self)
        if non_finite:
            raise ValueError(f"{', '.join(non_finite)}: options must be finite numbers.")
        if self.num_samples is not None and self.num_samples < 1:
            raise ValueError(f"num_samples must be at least 1, got {self.num_samples}.")
        if self.pass_at_k is not None and any(k < 1 for k in self.pass_at_k):
            raise ValueError(f"pass_at_k values must be at least 1, got {self.pass_at_k}.")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}.")
        if self.batch_size < 1 or self.vllm_problems_per_call < 1:
            raise ValueError("batch_size and vllm_problems_per_call must be at least 1.")
        vllm_problems = vllm_option_problems(self.vllm_gpu_memory_utilization, self.vllm_tensor_parallel_size)
        if vllm_problems:
            raise ValueError("; ".join(vllm_problems) + ".")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}.")
        if self.max_problems is not None and self.max_problems < 1:
            raise ValueError(f"max_problems must be at least 1, got {self.max_problems}.")
        if self.backend not in BACKENDS:
            raise ValueError(f"Unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}.")
        if self.device is not None:
            check_device(self.device)
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"Unknown dtype {self.dtype!r}; choose auto, bfloat16, float16 or float32.")
        if os.path.exists(self.output_dir) and not os.path.isdir(self.output_dir):
            raise ValueError(f"output_dir {self.output_dir!r} is a file; give a directory (it is created if missing).")
        self.prompt_and_reward_source = self._take_run_settings()
        get_template(self.prompt_template)  # unknown template: ValueError listing the valid ones
        check_math_reward_mode(self.math_reward_mode)
        parse_benchmark_files(self.benchmark_files)

    def _take_run_settings(self) -> str:
        """Set the prompt template and reward mode left unset to those the run was trained with, as the model folder
        records them (``opefo_run_options.json``, written by ``opefo-train`` into its final model and every
        checkpoint), else to the defaults (:data:`TRAINED_WITH`); return the line saying which are used, and why.

        Raises:
            ValueError: the folder's record is not a JSON mapping.
        """
        assert self.model_name_or_path is not None
        folder = os.path.expanduser(self.model_name_or_path)
        record = read_run_options(folder) if os.path.isdir(folder) else None
        where = os.path.join(folder, RUN_OPTIONS_NAME)
        missing = f"{folder} holds no {RUN_OPTIONS_NAME}" if os.path.isdir(folder) else "not a local run folder"
        used: dict[str, list[str]] = {}  # source: the settings it gave
        for name, default in TRAINED_WITH.items():
            if getattr(self, name) is not None:
                source = "given"
            elif record is not None and name in record:
                setattr(self, name, record[name])
                source = f"the run's, from {where}"
            else:
                setattr(self, name, default)
                source = f"default; {where} records none" if record is not None else f"default; {missing}"
            used.setdefault(source, []).append(f"{name}={getattr(self, name)!r}")
        said = " and ".join(f"{' and '.join(names)} ({source})" for source, names in used.items())
        from_run = any(source.startswith("the run's") for source in used)
        override = " Give --prompt_template / --math_reward_mode to choose others." if from_run else ""
        return f"Evaluating with {said}.{override}"

    def generation_settings(self, backend: str) -> dict[str, Any]:
        """The settings a stored sample depends on; resuming with different ones is refused."""
        return {
            "model_name_or_path": self.model_name_or_path,
            "base_model_name_or_path": self.base_model_name_or_path,
            "backend": backend,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_new_tokens": self.max_new_tokens,
            "prompt_template": self.prompt_template,
            "seed": self.seed,
            "dtype": self.dtype,
        }
