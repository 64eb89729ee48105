"""The benchmarks of the OPEFO paper's tables, local benchmark files, and their problems rendered as prompts."""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from opefo_trl.data.loading import LOCAL_FILE_BUILDERS, is_local_data_file, load_local_files
from opefo_trl.data.prompts import format_prompt, render_prompts


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
        return is_local_data_file(self.dataset_id)

    def load(self, data_files: str | None = None):
        """Load the split with ``datasets.load_dataset`` (from the hub, or from ``data_files`` / a local file with the
        same columns). Errors say which benchmark failed and why."""
        import datasets

        source = data_files or (self.dataset_id if self.is_local else None)
        if source is not None:
            return load_local_files(source)
        try:
            return datasets.load_dataset(self.dataset_id, self.dataset_config, split=self.split)
        except (FileNotFoundError, ValueError):
            raise
        except Exception as err:  # e.g. offline: opefo-eval reports a FileNotFoundError as one line, not a traceback
            raise FileNotFoundError(
                f"Could not load benchmark {self.name!r} from {self.dataset_id} (split {self.split!r}): "
                f"{type(err).__name__}: {err}. Offline, download it beforehand or pass a local copy with "
                f"benchmark_files={self.name}=PATH."
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


def parse_benchmark_files(entries: Sequence[str]) -> dict[str, str]:
    """``NAME=PATH`` entries (local copies of registered benchmarks) as ``{name: path}``.

    >>> parse_benchmark_files(["aime24=/data/aime.parquet"])
    {'aime24': '/data/aime.parquet'}
    """
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


class BenchmarkSelection(Protocol):
    """What :func:`resolve_benchmarks` reads from an ``EvaluationConfig`` (``opefo_trl.eval.config``)."""

    @property
    def benchmarks(self) -> Sequence[str]: ...
    @property
    def benchmark_files(self) -> Sequence[str]: ...
    @property
    def num_samples(self) -> int | None: ...
    @property
    def pass_at_k(self) -> Sequence[int] | None: ...
    @property
    def question_column(self) -> str: ...
    @property
    def answer_column(self) -> str: ...


def resolve_benchmarks(config: BenchmarkSelection) -> list[ResolvedBenchmark]:
    """Turn names / files into :class:`ResolvedBenchmark` s and check ``k <= n`` -- before loading anything.

    Raises:
        ValueError: unknown benchmark name (the message lists the valid ones), duplicate names, or a requested
            pass@k with ``k`` larger than a benchmark's ``n``.
    """
    files = parse_benchmark_files(config.benchmark_files)
    resolved, seen = [], set()
    for entry in config.benchmarks:
        if entry in BENCHMARKS:
            spec = BENCHMARKS[entry]
        elif is_local_data_file(entry):
            name = os.path.splitext(os.path.basename(entry))[0]
            spec = BenchmarkSpec(name, entry, "train", config.question_column, config.answer_column)
        else:
            raise ValueError(
                f"Unknown benchmark {entry!r}. Valid names: {', '.join(BENCHMARKS)}; or give a local file ending in "
                f"{', '.join(sorted(LOCAL_FILE_BUILDERS))}."
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


def build_prompt_ids(tokenizer, problems: Sequence[Problem], template: str) -> list[list[int]]:
    """Every problem formatted with the prompt ``template`` and rendered to token ids as training renders it.

    Raises:
        ValueError: the tokenizer has no chat template.
    """
    return render_prompts(tokenizer, [format_prompt(p.question, template) for p in problems])


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
