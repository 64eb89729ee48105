r"""Sampling-based evaluation of math reasoners: avg@n, pass@k and majority vote on the paper's benchmarks.

The API behind ``opefo-eval``. A model (a full checkpoint, a hub id, or a PEFT LoRA adapter directory) answers every
problem of one or more benchmarks ``n`` times; answers are scored with :func:`opefo_trl.rewards.verify_completion`
(the training reward's scorer) and summarised per benchmark and averaged over benchmarks, as in the OPEFO paper's
tables.

Protocol defaults follow the paper: temperature 1.0, top-p 0.7, ``n = 32`` on AIME24 / AIME25 / AMC23 and ``n = 1``
on MATH500 / Minerva / OlympiadBench (override with ``num_samples``). Sampling uses only temperature and top-p; the
model's ``generation_config`` defaults (top-k, repetition penalty) are not applied.

Backends:

- ``vllm`` (when installed; ``backend="auto"`` picks it on a GPU): one request per problem with ``n`` samples and a
  per-problem seed.
- ``transformers``: batched ``model.generate`` (left padding, several prompts x samples per call), also on CPU. Each
  sample is drawn with its own random generator seeded from ``(seed, benchmark, problem, sample index)`` (Gumbel-max
  sampling), so a sample does not depend on which other samples shared its batch.

Outputs in ``output_dir``:

- ``samples.jsonl``: one line per sample, appended and flushed after every generation batch. A re-run with the same
  settings skips what is already there, so an interrupted run resumes where it stopped and ends with the same
  result as an uninterrupted one.
- ``run_config.json``: the generation settings; resuming with different ones is refused.
- ``results.json``: settings, per-benchmark metrics, per-problem rows (extracted answers, scores, n, c, majority
  answer) and the average over benchmarks.
- ``results.md``: a markdown table, benchmarks x metrics, with an ``average`` row.

Metric names: ``avg@n`` (mean accuracy over the n samples = pass@1 estimate), ``maj@n`` (majority vote over extracted
answers), ``pass@k`` (unbiased estimator, for every requested k; default: 1, 2, 4, ... up to n). Problems whose gold
answer cannot be parsed are left out (``num_unscorable_problems``); samples whose verification failed count as wrong
and are reported (``num_verification_failures``).

Example:
    >>> from opefo_trl.evaluation import EvaluationConfig, evaluate
    >>> config = EvaluationConfig(
    ...     model_name_or_path="runs/opefo-7b", benchmarks=["aime24", "math500"], output_dir="runs/opefo-7b/eval"
    ... )
    >>> results = evaluate(config)  # doctest: +SKIP
    >>> results["benchmarks"]["aime24"]["metrics"]["avg@n"], results["average"]["avg@n"]  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import math
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from .pass_at_k import avg_at_n, majority_vote, mean_pass_at_k
from .templates import DEFAULT_TEMPLATE, PROMPT_TEMPLATES, format_prompt, get_template

logger = logging.getLogger(__name__)

SAMPLES_FILE = "samples.jsonl"
RUN_CONFIG_FILE = "run_config.json"
RESULTS_JSON = "results.json"
RESULTS_MARKDOWN = "results.md"
LOCAL_EXTENSIONS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
BACKENDS = ("auto", "vllm", "transformers")


# --------------------------------------------------------------------------------------------------------------------
# Benchmarks
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchmarkSpec:
    """Where a benchmark lives and how to read it.

    Attributes:
        name: Short name used on the command line and in the outputs.
        dataset_id: Hugging Face hub id, or a local file (``.json``, ``.jsonl``, ``.parquet``, ``.csv``).
        split: Split to evaluate (hub data sets).
        question_column: Column with the problem text.
        answer_column: Column with the gold answer (a string, a number, or a list of values).
        num_samples: Samples per problem of the paper's protocol (32 on AIME/AMC, 1 elsewhere).
        dataset_config: Hub configuration name, if any.
    """

    name: str
    dataset_id: str
    split: str
    question_column: str
    answer_column: str
    num_samples: int = 1
    dataset_config: str | None = None

    @property
    def is_local(self) -> bool:
        return os.path.splitext(self.dataset_id)[1].lower() in LOCAL_EXTENSIONS

    def load(self, data_files: str | None = None):
        """Load the split with ``datasets.load_dataset`` (from the hub, or from ``data_files`` / a local file with the
        same columns). Errors say which benchmark failed and why."""
        import datasets

        source = data_files or (self.dataset_id if self.is_local else None)
        try:
            if source is not None:
                if not os.path.isfile(source):
                    raise FileNotFoundError(f"Benchmark file {source!r} does not exist.")
                builder = LOCAL_EXTENSIONS.get(os.path.splitext(source)[1].lower())
                if builder is None:
                    raise ValueError(
                        f"Benchmark file {source!r} has an unsupported extension; use one of "
                        f"{', '.join(sorted(LOCAL_EXTENSIONS))}."
                    )
                return datasets.load_dataset(builder, data_files=source, split="train")
            return datasets.load_dataset(self.dataset_id, self.dataset_config, split=self.split)
        except (FileNotFoundError, ValueError):
            raise
        except Exception as err:
            where = source or f"{self.dataset_id} (split {self.split!r})"
            raise RuntimeError(
                f"Could not load benchmark {self.name!r} from {where}: {type(err).__name__}: {err}. "
                f"Offline, download it beforehand or pass a local copy with benchmark_files={self.name}=PATH."
            ) from err


BENCHMARKS: dict[str, BenchmarkSpec] = {
    spec.name: spec
    for spec in [
        BenchmarkSpec("aime24", "HuggingFaceH4/aime_2024", "train", "problem", "answer", num_samples=32),
        BenchmarkSpec("aime25", "math-ai/aime25", "test", "problem", "answer", num_samples=32),
        BenchmarkSpec("amc23", "math-ai/amc23", "test", "question", "answer", num_samples=32),
        BenchmarkSpec("math500", "HuggingFaceH4/MATH-500", "test", "problem", "answer"),
        BenchmarkSpec("minerva", "math-ai/minervamath", "test", "question", "answer"),
        BenchmarkSpec("olympiadbench", "math-ai/olympiadbench", "test", "question", "final_answer"),
    ]
}
PAPER_BENCHMARKS = ["aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench"]


@dataclass(frozen=True)
class Problem:
    """One benchmark problem: its row index (``problem_id``), question, gold answer and a fingerprint of both."""

    problem_id: int
    question: str
    gold: Any

    @property
    def fingerprint(self) -> str:
        payload = json.dumps([self.question, self.gold], ensure_ascii=False, default=str)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ResolvedBenchmark:
    """A benchmark with the sample count and pass@k values of this run."""

    spec: BenchmarkSpec
    num_samples: int
    k_values: tuple[int, ...]
    data_files: str | None = None

    @property
    def name(self) -> str:
        return self.spec.name


# --------------------------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------------------------


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
    prompt_template: str = field(
        default=DEFAULT_TEMPLATE,
        metadata={"help": f"Prompt template of opefo_trl.templates: {', '.join(PROMPT_TEMPLATES)}."},
    )
    seed: int = field(default=0, metadata={"help": "Base seed; every problem / sample derives its own seed from it."})
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

    def __post_init__(self):
        if isinstance(self.benchmarks, str):
            self.benchmarks = [self.benchmarks]
        if isinstance(self.pass_at_k, int):
            self.pass_at_k = [self.pass_at_k]
        if not self.model_name_or_path:
            raise ValueError("model_name_or_path is required: a checkpoint directory, a hub id or a LoRA adapter.")
        if not self.benchmarks:
            raise ValueError(f"No benchmarks given; choose from {', '.join(BENCHMARKS)} or pass local files.")
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
        if self.max_problems is not None and self.max_problems < 1:
            raise ValueError(f"max_problems must be at least 1, got {self.max_problems}.")
        if self.backend not in BACKENDS:
            raise ValueError(f"Unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}.")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"Unknown dtype {self.dtype!r}; choose auto, bfloat16, float16 or float32.")
        get_template(self.prompt_template)  # unknown template: ValueError listing the valid ones
        _parse_benchmark_files(self.benchmark_files)

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


def _parse_benchmark_files(entries: Sequence[str]) -> dict[str, str]:
    files = {}
    for entry in entries:
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"benchmark_files entries must look like NAME=PATH, got {entry!r}.")
        if name not in BENCHMARKS:
            raise ValueError(
                f"benchmark_files names a benchmark {name!r} that is not registered; valid: {', '.join(BENCHMARKS)}. "
                "For other data pass the file itself in `benchmarks`."
            )
        files[name] = path
    return files


def _default_k_values(n: int) -> tuple[int, ...]:
    return tuple(2**i for i in range(int(math.log2(n)) + 1))


def resolve_benchmarks(config: EvaluationConfig) -> list[ResolvedBenchmark]:
    """Turn names / files into :class:`ResolvedBenchmark` s and check ``k <= n`` -- before loading anything.

    Raises:
        ValueError: unknown benchmark name (the message lists the valid ones), duplicate names, or a requested
            pass@k with ``k`` larger than a benchmark's ``n``.
    """
    files = _parse_benchmark_files(config.benchmark_files)
    resolved, seen = [], set()
    for entry in config.benchmarks:
        if entry in BENCHMARKS:
            spec = BENCHMARKS[entry]
        elif os.path.splitext(entry)[1].lower() in LOCAL_EXTENSIONS:
            name = os.path.splitext(os.path.basename(entry))[0]
            spec = BenchmarkSpec(name, entry, "train", config.question_column, config.answer_column)
        else:
            raise ValueError(
                f"Unknown benchmark {entry!r}. Valid names: {', '.join(BENCHMARKS)}; or give a local file ending in "
                f"{', '.join(sorted(LOCAL_EXTENSIONS))}."
            )
        if spec.name in seen:
            raise ValueError(f"Benchmark {spec.name!r} is listed twice; rename one of the files.")
        seen.add(spec.name)
        n = config.num_samples or spec.num_samples
        if config.pass_at_k is None:
            k_values = _default_k_values(n)
        else:
            too_large = [k for k in config.pass_at_k if k > n]
            if too_large:
                raise ValueError(
                    f"pass@{too_large[0]} was requested but benchmark {spec.name!r} is sampled n={n} "
                    f"times per problem; "
                    f"pass@k needs k <= n. Raise num_samples to at least {max(too_large)} or drop those k values."
                )
            k_values = tuple(sorted(set(config.pass_at_k)))
        resolved.append(ResolvedBenchmark(spec, n, k_values, files.get(spec.name)))
    return resolved


def load_problems(benchmark: ResolvedBenchmark, max_problems: int | None = None) -> list[Problem]:
    """Load a benchmark's problems (row index = problem id).

    Raises:
        ValueError: a question or answer column is missing (the message lists the columns there are) or the
            benchmark is empty.
    """
    spec = benchmark.spec
    dataset = spec.load(benchmark.data_files)
    missing = [c for c in (spec.question_column, spec.answer_column) if c not in dataset.column_names]
    if missing:
        raise ValueError(
            f"Benchmark {spec.name!r} has no column {missing[0]!r}; its columns are {dataset.column_names}. "
            "Set question_column / answer_column to the right ones."
        )
    if len(dataset) == 0:
        raise ValueError(f"Benchmark {spec.name!r} is empty.")
    if max_problems is not None:
        dataset = dataset.select(range(min(max_problems, len(dataset))))
    problems = []
    for index, row in enumerate(dataset):
        question = row[spec.question_column]
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"Benchmark {spec.name!r}, row {index}: the question is empty or not text: {question!r}.")
        problems.append(Problem(index, question, row[spec.answer_column]))
    return problems


# --------------------------------------------------------------------------------------------------------------------
# Model source and backend choice
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSource:
    """The weights to load: a full model, or a base model plus a LoRA adapter."""

    model_path: str
    adapter_path: str | None = None
    tokenizer_path: str | None = None


def _looks_local(path: str) -> bool:
    return path.startswith(("/", ".", "~")) or path.count("/") > 1 or os.sep == "\\" and "\\" in path


def resolve_model_source(model_name_or_path: str, base_model_name_or_path: str | None = None) -> ModelSource:
    """Find out what ``model_name_or_path`` is without loading weights.

    A directory with ``adapter_config.json`` is a PEFT adapter (base: ``base_model_name_or_path`` or the adapter's
    own ``base_model_name_or_path``); a directory with ``config.json`` is a full model; anything else that is not a
    local-looking path is treated as a hub id.

    Raises:
        FileNotFoundError: a local path that does not exist, or a directory that holds no model.
        ValueError: an adapter whose base model is unknown.
    """
    path = os.path.expanduser(model_name_or_path)
    if os.path.isdir(path):
        adapter_config = os.path.join(path, "adapter_config.json")
        if os.path.isfile(adapter_config):
            with open(adapter_config) as f:
                base = base_model_name_or_path or json.load(f).get("base_model_name_or_path")
            if not base:
                raise ValueError(
                    f"{path} is a PEFT adapter whose adapter_config.json names no base model; pass "
                    "base_model_name_or_path."
                )
            base_path = os.path.expanduser(base)
            if _looks_local(base) and not os.path.isdir(base_path):
                raise FileNotFoundError(
                    f"The base model {base!r} of adapter {path} does not exist; pass base_model_name_or_path."
                )
            has_tokenizer = os.path.isfile(os.path.join(path, "tokenizer_config.json"))
            return ModelSource(base_path, adapter_path=path, tokenizer_path=path if has_tokenizer else base_path)
        if os.path.isfile(os.path.join(path, "config.json")):
            return ModelSource(path, tokenizer_path=path)
        raise FileNotFoundError(f"{path} holds neither a model (config.json) nor a PEFT adapter (adapter_config.json).")
    if os.path.exists(path) or _looks_local(model_name_or_path):
        raise FileNotFoundError(f"Model path {model_name_or_path!r} does not exist.")
    return ModelSource(model_name_or_path, tokenizer_path=model_name_or_path)


def vllm_is_available() -> bool:
    """Whether vLLM can be imported (checked without importing it)."""
    return importlib.util.find_spec("vllm") is not None


def select_backend(requested: str, vllm_available: bool | None = None, cuda_available: bool | None = None) -> str:
    """Resolve ``"auto"`` / ``"vllm"`` / ``"transformers"`` to the backend that will run.

    ``"auto"`` picks vLLM when it is installed and a GPU is visible, else transformers.

    Raises:
        ImportError: ``"vllm"`` was asked for but vLLM is not installed.

    Example:
        >>> auto = "auto"
        >>> select_backend(auto, vllm_available=False), select_backend(auto, vllm_available=True, cuda_available=True)
        ('transformers', 'vllm')
    """
    if requested not in BACKENDS:
        raise ValueError(f"Unknown backend {requested!r}; choose one of {', '.join(BACKENDS)}.")
    if vllm_available is None:
        vllm_available = vllm_is_available()
    if requested == "transformers":
        return "transformers"
    if requested == "vllm":
        if not vllm_available:
            raise ImportError(
                "backend='vllm' but vLLM is not installed: `pip install 'opefo-trl[vllm]'`, or use "
                "backend='transformers'."
            )
        return "vllm"
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    return "vllm" if vllm_available and cuda_available else "transformers"


# --------------------------------------------------------------------------------------------------------------------
# Seeds, prompts, generation jobs
# --------------------------------------------------------------------------------------------------------------------


def _hash_seed(*parts: Any) -> int:
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def sample_seed(seed: int, benchmark: str, problem_id: int, sample_index: int) -> int:
    """Seed of one sample (transformers backend): independent of batching and of where a run was interrupted."""
    return _hash_seed(seed, benchmark, problem_id, sample_index)


def problem_seed(seed: int, benchmark: str, problem_id: int, first_sample_index: int = 0) -> int:
    """Seed of one vLLM request (all missing samples of a problem, starting at ``first_sample_index``)."""
    return _hash_seed(seed, benchmark, problem_id, "request", first_sample_index)


@dataclass(frozen=True)
class SampleJob:
    """One sample to draw."""

    benchmark: str
    problem_id: int
    sample_index: int
    fingerprint: str
    prompt_ids: tuple[int, ...]


def build_prompt_ids(tokenizer, problems: Sequence[Problem], template: str) -> list[list[int]]:
    """Chat-template every problem and tokenize it (no extra special tokens: the template has them).

    Raises:
        ValueError: the tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"The tokenizer of {getattr(tokenizer, 'name_or_path', 'the model')} has no chat template, "
            "which the prompt templates need; use a tokenizer that has one (e.g. the instruct model's)."
        )
    texts = [
        tokenizer.apply_chat_template(format_prompt(p.question, template), tokenize=False, add_generation_prompt=True)
        for p in problems
    ]
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def context_length_warning(
    prompt_ids: Sequence[Sequence[int]], max_new_tokens: int, context_length: int | None
) -> str | None:
    """A warning when the longest prompt plus ``max_new_tokens`` exceeds the model's context (``None`` if it fits).

    Example:
        >>> print(context_length_warning([[1] * 1200], 3000, 4096))  # doctest: +NORMALIZE_WHITESPACE
        The longest prompt (1200 tokens) plus max_new_tokens=3000 exceeds the model context of 4096 tokens;
        long samples will run past it (lower max_new_tokens).
    """
    longest = max((len(ids) for ids in prompt_ids), default=0)
    if context_length is None or longest + max_new_tokens <= context_length:
        return None
    return (
        f"The longest prompt ({longest} tokens) plus max_new_tokens={max_new_tokens} exceeds the model context of "
        f"{context_length} tokens; long samples will run past it (lower max_new_tokens)."
    )


def build_vllm_requests(
    jobs: Sequence[SampleJob], config: EvaluationConfig
) -> list[tuple[dict[str, list[int]], dict[str, Any]]]:
    """Group jobs by problem into vLLM requests: ``({"prompt_token_ids": ...}, SamplingParams kwargs)``.

    One request per problem draws all its missing samples (``n``) with a per-problem seed. Jobs of one problem must
    be adjacent and in sample order (as :func:`pending_jobs` yields them).

    Example:
        >>> jobs = [SampleJob("b", 0, i, "f", (1, 2)) for i in range(3)]
        >>> prompt, sampling = build_vllm_requests(jobs, EvaluationConfig(model_name_or_path="m", max_new_tokens=5))[0]
        >>> prompt, sampling["n"], sampling["max_tokens"], sampling["top_p"]
        ({'prompt_token_ids': [1, 2]}, 3, 5, 0.7)
    """
    requests = []
    for group in _group_by_problem(jobs):
        first = group[0]
        sampling = {
            "n": len(group),
            "temperature": config.temperature,
            "top_p": config.top_p if config.temperature > 0 else 1.0,
            "top_k": 0,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "max_tokens": config.max_new_tokens,
            "seed": problem_seed(config.seed, first.benchmark, first.problem_id, first.sample_index),
        }
        requests.append(({"prompt_token_ids": list(first.prompt_ids)}, sampling))
    return requests


def _group_by_problem(jobs: Sequence[SampleJob]) -> list[list[SampleJob]]:
    groups: list[list[SampleJob]] = []
    for job in jobs:
        if groups and (groups[-1][0].benchmark, groups[-1][0].problem_id) == (job.benchmark, job.problem_id):
            if job.sample_index != groups[-1][-1].sample_index + 1:
                raise ValueError("Jobs of one problem must be in consecutive sample order.")
            groups[-1].append(job)
        else:
            groups.append([job])
    return groups


# --------------------------------------------------------------------------------------------------------------------
# Sample store (resumable JSONL)
# --------------------------------------------------------------------------------------------------------------------


class SampleStore:
    """Append-only JSONL of samples keyed by (benchmark, problem_id, sample_index), plus the run settings.

    Example:
        >>> store = SampleStore("runs/eval")                     # doctest: +SKIP
        >>> store.check_settings({"temperature": 1.0, ...})      # doctest: +SKIP
    """

    def __init__(self, output_dir: str, overwrite: bool = False):
        self.output_dir = output_dir
        self.samples_path = os.path.join(output_dir, SAMPLES_FILE)
        self.settings_path = os.path.join(output_dir, RUN_CONFIG_FILE)
        os.makedirs(output_dir, exist_ok=True)
        if overwrite:
            for path in (self.samples_path, self.settings_path):
                if os.path.exists(path):
                    os.remove(path)
        self.samples: dict[tuple[str, int, int], dict] = {}
        if os.path.exists(self.samples_path):
            self._read()

    def _read(self) -> None:
        with open(self.samples_path) as f:
            lines = f.readlines()
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if number == len(lines):  # a run killed mid-write leaves a partial last line: drop it
                    logger.warning("Dropping a truncated last line of %s (interrupted write).", self.samples_path)
                    self._rewrite_without_last_line(lines)
                    break
                raise ValueError(
                    f"{self.samples_path}, line {number}, is not valid JSON; fix or remove the file."
                ) from None
            self.samples[(record["benchmark"], record["problem_id"], record["sample_index"])] = record

    def _rewrite_without_last_line(self, lines: list[str]) -> None:
        tmp = self.samples_path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(lines[:-1])
        shutil.move(tmp, self.samples_path)

    def check_settings(self, settings: dict[str, Any]) -> None:
        """Store ``settings`` on the first run; on a re-run refuse to mix samples drawn with different ones."""
        if os.path.exists(self.settings_path):
            with open(self.settings_path) as f:
                stored = json.load(f)
            if self.samples:
                changed = {k: (stored.get(k), v) for k, v in settings.items() if stored.get(k) != v}
                if changed:
                    details = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changed.items())
                    raise ValueError(
                        f"{self.output_dir} holds samples drawn with other settings ({details}). Use another "
                        "output_dir, or overwrite=True (--overwrite) to discard them."
                    )
        with open(self.settings_path, "w") as f:
            json.dump(settings, f, indent=2)

    def check_problems(self, benchmark: str, problems: Sequence[Problem]) -> None:
        """Refuse stored samples of a problem whose question or gold answer changed since they were drawn."""
        fingerprints = {p.problem_id: p.fingerprint for p in problems}
        for (name, problem_id, _), record in self.samples.items():
            if name == benchmark and problem_id in fingerprints and record["fingerprint"] != fingerprints[problem_id]:
                raise ValueError(
                    f"Stored samples of {benchmark!r} problem {problem_id} were drawn for a different question or "
                    f"answer (the data changed). Use another output_dir or overwrite=True."
                )

    def append(self, records: Iterable[dict]) -> None:
        """Append records and flush them to disk."""
        with open(self.samples_path, "a") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
                self.samples[(record["benchmark"], record["problem_id"], record["sample_index"])] = record
            f.flush()
            os.fsync(f.fileno())

    def get(self, benchmark: str, problem_id: int, sample_index: int) -> dict | None:
        return self.samples.get((benchmark, problem_id, sample_index))


def pending_jobs(
    store: SampleStore, benchmark: ResolvedBenchmark, problems: Sequence[Problem], prompt_ids: Sequence[Sequence[int]]
) -> list[SampleJob]:
    """The samples of ``benchmark`` not yet in ``store``, in (problem, sample) order."""
    jobs = []
    for problem, ids in zip(problems, prompt_ids, strict=True):
        for index in range(benchmark.num_samples):
            if store.get(benchmark.name, problem.problem_id, index) is None:
                jobs.append(SampleJob(benchmark.name, problem.problem_id, index, problem.fingerprint, tuple(ids)))
    return jobs


# --------------------------------------------------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GeneratedSample:
    completion: str
    num_tokens: int
    finish_reason: str  # "stop" (end of sequence) or "length" (max_new_tokens reached)


def _torch_dtype(name: str, device: str):
    import torch

    if name == "auto":
        if device.startswith("cuda") and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float16 if device.startswith("cuda") else torch.float32
    return getattr(torch, name)


def _make_seeded_gumbel_processor():
    """Build the per-row seeded sampler class lazily (transformers is imported only when generating)."""
    import torch
    from transformers import LogitsProcessor

    class SeededGumbelSampler(LogitsProcessor):
        """Adds independent Gumbel noise per row, from one generator per row; greedy decoding of the result draws
        each row's token from softmax(scores) (Gumbel-max trick), reproducibly whatever the batch holds."""

        def __init__(self, seeds: Sequence[int], device):
            self.generators = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]

        def __call__(self, input_ids, scores):
            vocab = scores.shape[-1]
            tiny = torch.finfo(torch.float32).tiny
            uniform = torch.stack(
                [torch.rand(vocab, generator=g, device=scores.device, dtype=torch.float32) for g in self.generators]
            )
            gumbel = -torch.log(-torch.log(uniform.clamp_(min=tiny)))
            return scores.float() + gumbel

    return SeededGumbelSampler


class TransformersBackend:
    """Batched ``model.generate`` with per-sample seeds; runs on CPU or GPU.

    Several prompts x samples go into one ``generate`` call (left padded); each row samples with its own random
    generator (temperature and top-p via transformers' warpers, then Gumbel-max), so results do not depend on how
    jobs were batched.
    """

    def __init__(self, model, tokenizer, config: EvaluationConfig):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.device = next(model.parameters()).device
        eos = model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
        if tokenizer.eos_token_id is not None:
            eos_ids.add(tokenizer.eos_token_id)
        if not eos_ids:
            raise ValueError(
                "Neither the model's generation_config nor the tokenizer defines an end-of-sequence token."
            )
        self.eos_ids = sorted(eos_ids)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]
        self._sampler_cls = _make_seeded_gumbel_processor()

    @classmethod
    def load(cls, source: ModelSource, config: EvaluationConfig, tokenizer) -> TransformersBackend:
        import torch
        from transformers import AutoModelForCausalLM

        device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        model = AutoModelForCausalLM.from_pretrained(
            source.model_path,
            dtype=_torch_dtype(config.dtype, device),
            device_map=device if device.startswith("cuda") else None,  # straight to the GPU, no CPU copy
        )
        if source.adapter_path is not None:
            try:
                from peft import PeftModel
            except ImportError as err:
                raise ImportError("Evaluating a LoRA adapter needs peft: `pip install 'opefo-trl[peft]'`.") from err
            model = PeftModel.from_pretrained(model, source.adapter_path).merge_and_unload()
        model.to(device).eval()
        return cls(model, tokenizer, config)

    def generate(self, jobs: Sequence[SampleJob], seeds: Sequence[int]) -> list[GeneratedSample]:
        """Draw one sample per job in a single ``generate`` call."""
        import torch
        from transformers import GenerationConfig, LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

        width = max(len(job.prompt_ids) for job in jobs)
        input_ids = torch.full((len(jobs), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(jobs), width), dtype=torch.long)
        for row, job in enumerate(jobs):
            input_ids[row, width - len(job.prompt_ids) :] = torch.tensor(job.prompt_ids)
            attention_mask[row, width - len(job.prompt_ids) :] = 1
        processors = LogitsProcessorList()
        if self.config.temperature > 0:
            processors.append(TemperatureLogitsWarper(self.config.temperature))
            if self.config.top_p < 1.0:
                processors.append(TopPLogitsWarper(self.config.top_p))
            processors.append(self._sampler_cls(seeds, self.device))
        generation_config = GenerationConfig(
            max_new_tokens=self.config.max_new_tokens,
            do_sample=False,  # greedy over Gumbel-perturbed scores = sampling (see SeededGumbelSampler)
            num_beams=1,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
            # Neutral values, so that the model's generation_config (e.g. top_k=20, repetition_penalty=1.05) is not
            # merged in: the protocol is temperature + top-p only.
            temperature=1.0,
            top_k=50,
            top_p=1.0,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
        )
        with torch.inference_mode():
            output = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                generation_config=generation_config,
                logits_processor=processors,
            )
        completions = output[:, width:].tolist()
        samples = []
        eos = set(self.eos_ids)
        for ids in completions:
            end = next((i for i, t in enumerate(ids) if t in eos), None)
            kept = ids if end is None else ids[: end + 1]
            text = self.tokenizer.decode(kept, skip_special_tokens=True)
            samples.append(GeneratedSample(text, len(kept), "length" if end is None else "stop"))
        return samples

    def run(self, jobs: Sequence[SampleJob]) -> Iterator[tuple[list[SampleJob], list[GeneratedSample]]]:
        """Yield (jobs, samples) batch by batch."""
        for start in range(0, len(jobs), self.config.batch_size):
            batch = list(jobs[start : start + self.config.batch_size])
            seeds = [sample_seed(self.config.seed, j.benchmark, j.problem_id, j.sample_index) for j in batch]
            yield batch, self.generate(batch, seeds)


class VLLMBackend:
    """vLLM generation: one request per problem with ``n`` samples (imported lazily)."""

    def __init__(self, source: ModelSource, config: EvaluationConfig):
        from vllm import LLM

        self.config = config
        kwargs = dict(
            model=source.model_path,
            tokenizer=source.tokenizer_path or source.model_path,
            seed=config.seed,
            dtype=config.dtype,
            gpu_memory_utilization=config.vllm_gpu_memory_utilization,
            tensor_parallel_size=config.vllm_tensor_parallel_size,
            max_model_len=config.max_model_len,
        )
        self.lora_request = None
        if source.adapter_path is not None:
            from vllm.lora.request import LoRARequest

            with open(os.path.join(source.adapter_path, "adapter_config.json")) as f:
                rank = int(json.load(f).get("r", 16))
            # vLLM accepts power-of-two LoRA ranks from 8 up.
            kwargs.update(enable_lora=True, max_lora_rank=2 ** math.ceil(math.log2(max(8, rank))))
            self.lora_request = LoRARequest("adapter", 1, source.adapter_path)
        self.llm = LLM(**kwargs)

    def run(self, jobs: Sequence[SampleJob]) -> Iterator[tuple[list[SampleJob], list[GeneratedSample]]]:
        from vllm import SamplingParams

        groups = _group_by_problem(jobs)
        for start in range(0, len(groups), self.config.vllm_problems_per_call):
            chunk = groups[start : start + self.config.vllm_problems_per_call]
            batch_jobs = [job for group in chunk for job in group]
            requests = build_vllm_requests(batch_jobs, self.config)
            outputs = self.llm.generate(
                [prompt for prompt, _ in requests],
                [SamplingParams(**sampling) for _, sampling in requests],
                lora_request=self.lora_request,
                use_tqdm=False,
            )
            samples = []
            for group, output in zip(chunk, outputs, strict=True):
                if len(output.outputs) != len(group):
                    raise RuntimeError(f"vLLM returned {len(output.outputs)} samples, {len(group)} were requested.")
                for completion in output.outputs:
                    finish = "length" if completion.finish_reason == "length" else "stop"
                    samples.append(GeneratedSample(completion.text, len(completion.token_ids), finish))
            yield batch_jobs, samples


# --------------------------------------------------------------------------------------------------------------------
# Scoring and metrics
# --------------------------------------------------------------------------------------------------------------------


def score_problem(problem: Problem, completions: Sequence[str]) -> dict[str, Any]:
    """Score one problem's completions: a per-problem row with extracted answers, scores, n, c and the vote.

    Returns a row with ``scorable=False`` (and no correctness) when the gold answer cannot be parsed.

    Example:
        >>> row = score_problem(Problem(0, "1+1?", "2"), [r"\\boxed{2}", "Answer: 3", r"\\boxed{2}"])
        >>> row["n"], row["c"], row["answers"], row["majority_answer"], row["majority_correct"]
        (3, 2, ['2', '3', '2'], '2', True)
    """
    from .rewards import FAILED, verify_completion

    results = [verify_completion(text, problem.gold) for text in completions]
    scorable = all(r.gold_scorable for r in results)  # an unreadable gold answer is not 0 correct
    correct = [r.score == 1.0 for r in results]
    answers = [r.answer for r in results]
    majority_answer, majority_correct = majority_vote(answers, correct)
    return {
        "problem_id": problem.problem_id,
        "question": problem.question,
        "gold": problem.gold,
        "scorable": scorable,
        "n": len(results),
        "c": sum(correct) if scorable else None,
        "answers": answers,
        "scores": [r.score for r in results],
        "statuses": [r.status for r in results],
        "num_verification_failures": sum(r.status == FAILED for r in results),
        "majority_answer": majority_answer,
        "majority_correct": majority_correct if scorable else None,
    }


def compute_benchmark_metrics(rows: Sequence[dict], k_values: Sequence[int]) -> dict[str, Any]:
    """Benchmark metrics from per-problem rows (as :func:`score_problem` returns them).

    ``avg@n`` averages c/n over scorable problems, ``maj@n`` the majority-vote correctness, ``pass@k`` the unbiased
    estimator; unscorable problems are counted, not scored.

    Raises:
        ValueError: a ``k`` larger than some problem's ``n``.

    Example:
        >>> rows = [{"n": 4, "c": 1, "scorable": True, "majority_correct": False, "num_verification_failures": 0},
        ...         {"n": 4, "c": 4, "scorable": True, "majority_correct": True, "num_verification_failures": 0}]
        >>> m = compute_benchmark_metrics(rows, [1, 2])
        >>> m["avg@n"], m["maj@n"], round(m["pass@2"], 4)
        (0.625, 0.5, 0.75)
    """
    scored = [row for row in rows if row["scorable"]]
    metrics: dict[str, Any] = {
        "num_problems": len(rows),
        "num_unscorable_problems": len(rows) - len(scored),
        "n": max((row["n"] for row in rows), default=0),
        "num_verification_failures": sum(row["num_verification_failures"] for row in rows),
    }
    if not scored:
        logger.warning("No problem could be scored (all gold answers unparseable).")
        return metrics
    num_samples, num_correct = [row["n"] for row in scored], [row["c"] for row in scored]
    metrics["avg@n"] = avg_at_n(num_samples, num_correct)
    metrics["maj@n"] = sum(bool(row["majority_correct"]) for row in scored) / len(scored)
    for k in k_values:
        metrics[f"pass@{k}"] = mean_pass_at_k(num_samples, num_correct, k)
    return metrics


AVERAGED_METRICS_PREFIXES = ("avg@n", "maj@n", "pass@")


def average_over_benchmarks(metrics_by_benchmark: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Mean of every score metric that all benchmarks have (the paper's "average" column)."""
    if not metrics_by_benchmark:
        return {}
    names = [
        key
        for key in next(iter(metrics_by_benchmark.values()))
        if key.startswith(AVERAGED_METRICS_PREFIXES) and all(key in m for m in metrics_by_benchmark.values())
    ]
    return {key: sum(m[key] for m in metrics_by_benchmark.values()) / len(metrics_by_benchmark) for key in names}


def format_markdown_table(metrics_by_benchmark: dict[str, dict[str, Any]], average: dict[str, float]) -> str:
    """A markdown table: one row per benchmark plus ``average``; scores in percent.

    Example:
        >>> print(format_markdown_table({"b": {"num_problems": 2, "n": 4, "avg@n": 0.5, "maj@n": 1.0, "pass@1": 0.5}},
        ...                             {"avg@n": 0.5, "maj@n": 1.0, "pass@1": 0.5}))
        | benchmark | problems | n | avg@n | maj@n | pass@1 |
        |---|---|---|---|---|---|
        | b | 2 | 4 | 50.0 | 100.0 | 50.0 |
        | average |  |  | 50.0 | 100.0 | 50.0 |
    """
    score_columns = ["avg@n", "maj@n"]
    ks = sorted(
        {int(key[5:]) for m in metrics_by_benchmark.values() for key in m if key.startswith("pass@")},
    )
    score_columns += [f"pass@{k}" for k in ks]
    header = ["benchmark", "problems", "n"] + score_columns
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def cell(metrics, key):
        return f"{100 * metrics[key]:.1f}" if key in metrics else "-"

    for name, metrics in metrics_by_benchmark.items():
        row = [name, str(metrics.get("num_problems", "")), str(metrics.get("n", ""))]
        lines.append("| " + " | ".join(row + [cell(metrics, key) for key in score_columns]) + " |")
    if len(metrics_by_benchmark) > 0:
        lines.append("| " + " | ".join(["average", "", ""] + [cell(average, key) for key in score_columns]) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------------------------


def _load_tokenizer(source: ModelSource):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source.tokenizer_path or source.model_path)


def _context_length(source: ModelSource) -> int | None:
    from transformers import AutoConfig

    try:
        model_config = AutoConfig.from_pretrained(source.model_path)
    except Exception as err:  # the check is advisory; the model load below reports real problems
        logger.debug("Could not read the model config for the context-length check: %s", err)
        return None
    return getattr(model_config.get_text_config(), "max_position_embeddings", None)


def evaluate(
    config: EvaluationConfig,
    backend_factory: Callable[[ModelSource, EvaluationConfig, Any], Any] | None = None,
) -> dict[str, Any]:
    """Sample, score and summarise; write ``samples.jsonl``, ``results.json`` and ``results.md``; return the results.

    Everything that can be checked without the model is checked first (benchmark names, ``k <= n``, model path,
    backend, data columns, stored samples); the model is loaded only if samples are missing.

    Args:
        config: The evaluation options.
        backend_factory: Advanced: ``(model_source, config, tokenizer) -> backend`` replacing the built-in backends
            (an object whose ``run(jobs)`` yields ``(jobs, GeneratedSample list)`` batches).

    Returns:
        The content of ``results.json``: ``{"config", "benchmarks": {name: {"metrics", "problems"}}, "average",
        "markdown"}``.
    """
    benchmarks = resolve_benchmarks(config)
    source = resolve_model_source(config.model_name_or_path, config.base_model_name_or_path)
    backend_name = "custom" if backend_factory is not None else select_backend(config.backend)
    problems_by_benchmark = {b.name: load_problems(b, config.max_problems) for b in benchmarks}

    store = SampleStore(config.output_dir, overwrite=config.overwrite)
    store.check_settings(config.generation_settings(backend_name))
    for benchmark in benchmarks:
        store.check_problems(benchmark.name, problems_by_benchmark[benchmark.name])

    tokenizer = None
    jobs: list[SampleJob] = []
    if any(
        store.get(b.name, p.problem_id, i) is None
        for b in benchmarks
        for p in problems_by_benchmark[b.name]
        for i in range(b.num_samples)
    ):
        tokenizer = _load_tokenizer(source)
        context_length = config.max_model_len or _context_length(source)
        for benchmark in benchmarks:
            problems = problems_by_benchmark[benchmark.name]
            prompt_ids = build_prompt_ids(tokenizer, problems, config.prompt_template)
            warning = context_length_warning(prompt_ids, config.max_new_tokens, context_length)
            if warning:
                logger.warning("%s: %s", benchmark.name, warning)
            jobs += pending_jobs(store, benchmark, problems, prompt_ids)

    if jobs:
        _generate(jobs, store, source, config, backend_name, tokenizer, backend_factory)

    results = _summarise(config, benchmarks, problems_by_benchmark, store, backend_name)
    with open(os.path.join(config.output_dir, RESULTS_JSON), "w") as f:
        json.dump(results, f, indent=2, ensure_ascii=False, default=str)
    with open(os.path.join(config.output_dir, RESULTS_MARKDOWN), "w") as f:
        f.write(results["markdown"] + "\n")
    return results


def _generate(jobs, store, source, config, backend_name, tokenizer, backend_factory) -> None:
    from tqdm.auto import tqdm

    if backend_factory is not None:
        backend = backend_factory(source, config, tokenizer)
    elif backend_name == "vllm":
        backend = VLLMBackend(source, config)
    else:
        backend = TransformersBackend.load(source, config, tokenizer)
    with tqdm(total=len(jobs), desc="Sampling", unit="sample", disable=not config.progress) as bar:
        for batch, samples in backend.run(jobs):
            store.append(
                {
                    "benchmark": job.benchmark,
                    "problem_id": job.problem_id,
                    "sample_index": job.sample_index,
                    "fingerprint": job.fingerprint,
                    "completion": sample.completion,
                    "num_tokens": sample.num_tokens,
                    "finish_reason": sample.finish_reason,
                }
                for job, sample in zip(batch, samples, strict=True)
            )
            bar.set_postfix(benchmark=batch[-1].benchmark, refresh=False)
            bar.update(len(batch))


def _summarise(config, benchmarks, problems_by_benchmark, store, backend_name) -> dict[str, Any]:
    per_benchmark = {}
    for benchmark in benchmarks:
        rows = []
        num_tokens, truncated, total = 0, 0, 0
        for problem in problems_by_benchmark[benchmark.name]:
            records = [store.get(benchmark.name, problem.problem_id, i) for i in range(benchmark.num_samples)]
            rows.append(score_problem(problem, [r["completion"] for r in records]))
            num_tokens += sum(r["num_tokens"] for r in records)
            truncated += sum(r["finish_reason"] == "length" for r in records)
            total += len(records)
        metrics = compute_benchmark_metrics(rows, benchmark.k_values)
        metrics["mean_completion_tokens"] = num_tokens / total
        metrics["truncated_fraction"] = truncated / total
        if metrics["num_unscorable_problems"]:
            logger.warning(
                "%s: %d problem(s) have a gold answer math-verify cannot parse; they are left out of the scores.",
                benchmark.name,
                metrics["num_unscorable_problems"],
            )
        per_benchmark[benchmark.name] = {"metrics": metrics, "problems": rows}
    metrics_by_benchmark = {name: result["metrics"] for name, result in per_benchmark.items()}
    average = average_over_benchmarks(metrics_by_benchmark)
    settings = dataclasses.asdict(config)
    settings["resolved_backend"] = backend_name
    settings["num_samples_per_benchmark"] = {b.name: b.num_samples for b in benchmarks}
    return {
        "config": settings,
        "benchmarks": per_benchmark,
        "average": average,
        "markdown": format_markdown_table(metrics_by_benchmark, average),
    }
