r"""Sampling-based evaluation of math reasoners: avg@n, pass@k and majority vote on the paper's benchmarks.

The API behind ``opefo-eval``. A model (a full checkpoint, a hub id, or a PEFT LoRA adapter directory) answers every
problem of one or more benchmarks ``n`` times; answers are scored with :func:`opefo_trl.data.rewards.verify_completion`
(the training reward's scorer, in the ``math_reward_mode`` given) and summarised per benchmark and averaged over
benchmarks, as in the OPEFO paper's tables.

Protocol defaults follow the paper: temperature 1.0, top-p 0.7, ``n = 32`` on AIME24 / AIME25 / AMC23 and ``n = 1``
on MATH500 / Minerva / OlympiadBench (override with ``num_samples``). Sampling uses only temperature and top-p; the
model's ``generation_config`` defaults (top-k, repetition penalty) are not applied. Prompts are rendered exactly as
``opefo-train`` renders them (:func:`opefo_trl.data.prompts.render_prompts`).

Modules: :mod:`~opefo_trl.eval.benchmarks` (registry, problems, prompts), :mod:`~opefo_trl.eval.config`
(:class:`EvaluationConfig`), :mod:`~opefo_trl.eval.store` (resumable samples, per-sample seeds),
:mod:`~opefo_trl.eval.backends` (model source, transformers and vLLM generation), :mod:`~opefo_trl.eval.metrics`
(scores and tables) and :mod:`~opefo_trl.eval.runner` (:func:`evaluate`). Every public name is importable from
``opefo_trl.eval``.

Backends: ``vllm`` (when installed; ``backend="auto"`` picks it on a GPU) and ``transformers`` (batched
``model.generate``, also on CPU).

Reproducibility. Sample ``i`` of problem ``p`` of benchmark ``b`` is drawn with its own seed, a hash of
``(seed, b, p, i)`` only: on both backends its random draws do not depend on which other samples share its batch,
nor on how many samples of its problem were stored before an interruption (vLLM gets one ``n=1`` request per sample
with that seed; transformers one seeded Gumbel-max generator per row). A sample's *tokens* also depend on the
model's logits, which are bit-identical only for the same backend, dtype, batch shape (``batch_size`` and the same
set of pending samples, hence the same left-padding width), hardware and library versions. So:

- re-running the same command on a finished or identically interrupted output_dir reproduces it exactly;
- a resumed run batches the remaining samples differently from an uninterrupted one; in float32 with transformers
  this has given identical samples in our tests (the tiny test model on CPU), but in bfloat16 / float16 the rounding
  of differently padded batches can change a sampled token and everything after it;
- vLLM batches requests dynamically, so its samples are not bit-reproducible across runs even with the same seeds.

Such differences change individual samples, not the distribution they are drawn from, so the metrics stay unbiased.

Outputs in ``output_dir``:

- ``samples.jsonl``: one line per sample (with its seed), appended and flushed after every generation batch. A
  re-run with the same settings skips what is already there, so an interrupted run resumes where it stopped (a
  last line cut off by the interruption is dropped; a whole last line missing its newline gets it back).
- ``run_config.json``: the generation settings and content fingerprints of the weight files (adapter included;
  :func:`opefo_trl.data.model_files.weight_fingerprints`) and of the tokenizer, chat template, config and
  generation config (:func:`opefo_trl.data.model_files.model_file_fingerprints`); resuming with other settings, or
  after any of those files changed (e.g. more training into the model's directory, an edited chat template), is
  refused, and so are samples without a whole ``run_config.json`` beside them. A hub model is known by its id only.
- ``results.json``: settings, per-benchmark metrics, per-problem rows (extracted answers, scores, n, c, majority
  answer) and the average over benchmarks.
- ``results.md``: a markdown table, benchmarks x metrics, with an ``average`` row.

Metric names: ``avg@n`` (mean accuracy over the n samples = pass@1 estimate), ``maj@n`` (majority vote over extracted
answers), ``pass@k`` (unbiased estimator, for every requested k; default: 1, 2, 4, ... up to n). Problems whose gold
answer cannot be parsed are left out (``num_unscorable_problems``); samples whose verification failed count as wrong
and are reported (``num_verification_failures``).

Example:
    >>> from opefo_trl.eval import EvaluationConfig, evaluate
    >>> config = EvaluationConfig(
    ...     model_name_or_path="runs/opefo-7b", benchmarks=["aime24", "math500"], output_dir="runs/opefo-7b/eval"
    ... )
    >>> results = evaluate(config)  # doctest: +SKIP
    >>> results["benchmarks"]["aime24"]["metrics"]["avg@n"], results["average"]["avg@n"]  # doctest: +SKIP
"""

from .backends import (
    GeneratedSample,
    ModelSource,
    TransformersBackend,
    VLLMBackend,
    build_vllm_requests,
    resolve_model_source,
    select_backend,
    vllm_is_available,
)
from .benchmarks import (
    BENCHMARKS,
    PAPER_BENCHMARKS,
    BenchmarkSpec,
    Problem,
    ResolvedBenchmark,
    build_prompt_ids,
    context_length_warning,
    load_problems,
    parse_benchmark_files,
    resolve_benchmarks,
)
from .config import BACKENDS, EvaluationConfig
from .metrics import average_over_benchmarks, compute_benchmark_metrics, format_markdown_table, score_problem
from .runner import RESULTS_JSON, RESULTS_MARKDOWN, evaluate
from .store import RUN_CONFIG_FILE, SAMPLES_FILE, SampleJob, SampleStore, pending_jobs, sample_seed

__all__ = [
    "BACKENDS",
    "BENCHMARKS",
    "PAPER_BENCHMARKS",
    "RESULTS_JSON",
    "RESULTS_MARKDOWN",
    "RUN_CONFIG_FILE",
    "SAMPLES_FILE",
    "BenchmarkSpec",
    "EvaluationConfig",
    "GeneratedSample",
    "ModelSource",
    "Problem",
    "ResolvedBenchmark",
    "SampleJob",
    "SampleStore",
    "TransformersBackend",
    "VLLMBackend",
    "average_over_benchmarks",
    "build_prompt_ids",
    "build_vllm_requests",
    "compute_benchmark_metrics",
    "context_length_warning",
    "evaluate",
    "format_markdown_table",
    "load_problems",
    "parse_benchmark_files",
    "pending_jobs",
    "resolve_benchmarks",
    "resolve_model_source",
    "sample_seed",
    "score_problem",
    "select_backend",
    "vllm_is_available",
]
