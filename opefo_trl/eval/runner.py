"""The evaluation entry point: check everything, sample what is missing, score, summarise and write the results."""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
from collections.abc import Callable
from typing import Any

from opefo_trl.data.loading import check_datasets_cache
from opefo_trl.data.model_files import model_context_length
from opefo_trl.runs.files import (
    SAMPLES_FILE,
    free_bytes,
    unwritable_reason,
    write_json_atomically,
    write_text_atomically,
)
from opefo_trl.runs.folder import RunLock

from .backends import (
    ModelSource,
    TransformersBackend,
    VLLMBackend,
    loading_error,
    resolve_model_source,
    select_backend,
)
from .benchmarks import build_prompt_ids, context_length_warning, load_problems, resolve_benchmarks
from .config import EvaluationConfig
from .metrics import average_over_benchmarks, compute_benchmark_metrics, format_markdown_table, score_problem
from .store import MODEL_FILES_KEY, WEIGHTS_KEY, SampleJob, SampleStore, StoreWriteError, pending_jobs

logger = logging.getLogger(__name__)

#: What two opefo-eval runs into one output_dir would mix (the message the second one gets).
STORE_MIXES = "their samples (both runs' draws in one samples.jsonl, under one run_config.json)"
RESULTS_JSON = "results.json"
RESULTS_MARKDOWN = "results.md"


def _load_tokenizer(source: ModelSource):
    from transformers import AutoTokenizer

    name = source.tokenizer_path or source.model_path
    try:
        return AutoTokenizer.from_pretrained(name)
    except OSError as err:  # not on the hub, not in the cache when offline, or a directory without a tokenizer
        raise loading_error(f"the tokenizer of {name!r}", err) from err


def _context_length(source: ModelSource, config: EvaluationConfig, backend_name: str) -> int | None:
    """The model's context for the length warning (capped by ``max_model_len`` under vLLM); None if unreadable."""
    max_model_len = config.max_model_len if backend_name == "vllm" else None
    try:
        return model_context_length(source.model_path, max_model_len=max_model_len)
    except Exception as err:  # the check is advisory; loading the model reports real problems
        logger.debug("Could not read the model config for the context-length check: %s", err)
        return max_model_len


def evaluate(
    config: EvaluationConfig,
    backend_factory: Callable[[ModelSource, EvaluationConfig, Any], Any] | None = None,
) -> dict[str, Any]:
    """Sample, score and summarise; write ``samples.jsonl``, ``results.json`` and ``results.md``; return the results.

    Everything that can be checked without the model is checked first (benchmark names, ``k <= n``, model path and
    its weights, backend, data columns, stored samples and the weights, tokenizer, chat template and generation
    config they were drawn with, and that the weights hold no NaN or inf); the model is loaded only if samples are
    missing. One run writes a store at a time:
    a run into an ``output_dir`` another run holds is refused at once (``RunFolderBusy``, the lock of
    :class:`opefo_trl.runs.RunLock`), as is one into a folder it cannot write (``RunFolderError``).

    Args:
        config: The evaluation options.
        backend_factory: Advanced: ``(model_source, config, tokenizer) -> backend`` replacing the built-in backends
            (an object whose ``run(jobs)`` yields ``(jobs, GeneratedSample list)`` batches).

    Returns:
        The content of ``results.json``: ``{"config", "benchmarks": {name: {"metrics", "problems"}}, "average",
        "markdown"}``.
    """
    reason = unwritable_reason(config.output_dir)
    if reason:
        raise ValueError(
            f"Cannot write into output_dir {config.output_dir!r} ({reason}); give a folder this user can write to."
        )
    check_datasets_cache()
    benchmarks = resolve_benchmarks(config)
    assert config.model_name_or_path is not None  # EvaluationConfig.__post_init__ requires it
    source = resolve_model_source(config.model_name_or_path, config.base_model_name_or_path)
    source.check_finite_weights()  # NaN weights generate nothing to score
    backend_name = "custom" if backend_factory is not None else select_backend(config.backend)
    problems_by_benchmark = {b.name: load_problems(b, config.max_problems) for b in benchmarks}

    # One writer per store, with opefo-train's lock: two runs would interleave their draws in one samples.jsonl.
    lock = RunLock(config.output_dir, mixes=STORE_MIXES)
    store = None
    try:
        lock.acquire()
        store = SampleStore(config.output_dir, overwrite=config.overwrite)
        inputs = (benchmarks, problems_by_benchmark, source, backend_name, backend_factory)
        return _sample_and_score(config, store, *inputs)
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise StoreWriteError(_disk_full_message(config.output_dir, err, store)) from err
    finally:
        lock.release()


def _disk_full_message(output_dir: str, err: OSError, store: SampleStore | None) -> str:
    """What is full and what was kept: every file of the store and the results is written whole or not at all
    (``samples.jsonl`` is cut back to its earlier samples)."""
    where = err.filename or output_dir
    samples = os.path.join(output_dir, SAMPLES_FILE)
    stored = len(store.samples) if store is not None else _count_lines(samples)  # none read yet: those on disk
    kept = f"the {stored} samples stored in {samples}" if stored else f"no samples yet (none in {samples})"
    return (
        f"Cannot write {where}: its disk is full ({err.strerror or err}; {free_bytes(where)} bytes free). Kept: "
        f"{kept}; no file of {output_dir} is left half-written. Free space on that disk (or give another "
        "output_dir), then run the command again: it samples only what is missing."
    )


def _count_lines(path: str) -> int:
    """The number of whole (newline-ended), non-blank lines of ``path`` (0 if it cannot be read)."""
    try:
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip() and line.endswith(b"\n"))
    except OSError:
        return 0


def _sample_and_score(config, store, benchmarks, problems_by_benchmark, source, backend_name, backend_factory):
    """:func:`evaluate` once its store is locked: check the stored samples, draw the missing ones, write results."""
    store.check_settings(
        {
            **config.generation_settings(backend_name),
            WEIGHTS_KEY: source.weight_fingerprints(),
            MODEL_FILES_KEY: source.file_fingerprints(),
        }
    )
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
        context_length = _context_length(source, config, backend_name)
        for benchmark in benchmarks:
            problems = problems_by_benchmark[benchmark.name]
            prompt_ids = build_prompt_ids(tokenizer, problems, config.prompt_template)
            warning = context_length_warning(prompt_ids, config.max_new_tokens, context_length)
            if warning:
                logger.warning("%s: %s", benchmark.name, warning)
            jobs += pending_jobs(store, benchmark, problems, prompt_ids, config.seed)

    if jobs:
        _generate(jobs, store, source, config, backend_name, tokenizer, backend_factory)

    results = _summarise(config, benchmarks, problems_by_benchmark, store, backend_name)
    # Whole or not at all: a full disk leaves the earlier results as they were, not an empty results.json.
    write_json_atomically(
        os.path.join(config.output_dir, RESULTS_JSON), results, indent=2, ensure_ascii=False, default=str
    )
    write_text_atomically(os.path.join(config.output_dir, RESULTS_MARKDOWN), results["markdown"] + "\n")
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
                    "seed": job.seed,
                    "completion": sample.completion,
                    "num_tokens": sample.num_tokens,
                    "finish_reason": sample.finish_reason,
                }
                for job, sample in zip(batch, samples, strict=True)
            )
            bar.set_postfix(benchmark=batch[-1].benchmark, refresh=False)
            bar.update(len(batch))


def _summarise(config, benchmarks, problems_by_benchmark, store, backend_name) -> dict[str, Any]:
    per_benchmark: dict[str, dict[str, Any]] = {}
    for benchmark in benchmarks:
        rows = []
        num_tokens, truncated, total = 0, 0, 0
        for problem in problems_by_benchmark[benchmark.name]:
            records = [store.get(benchmark.name, problem.problem_id, i) for i in range(benchmark.num_samples)]
            rows.append(score_problem(problem, [r["completion"] for r in records], config.math_reward_mode))
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
