"""`opefo-eval`: sample a model on math benchmarks and report avg@n, maj@n and pass@k (also `python -m
opefo_trl.cli.evaluate`).

Every field of `opefo_trl.evaluation.EvaluationConfig` is a flag (`--help` lists them); `--config eval.yaml` reads
them from a YAML file, command-line flags override it, and unknown keys are errors. Wrong input (unknown benchmark,
missing column, missing model path, pass@k with k > n) is reported before the model is loaded. Re-running the same
command resumes an interrupted run from `OUTPUT_DIR/samples.jsonl`.

Examples:
    # The paper's protocol (n=32 on AIME24/AIME25/AMC23, n=1 elsewhere; temperature 1.0, top-p 0.7):
    opefo-eval --model_name_or_path runs/opefo-7b --output_dir runs/opefo-7b/eval
    # pass@k curve on AIME24 for a LoRA adapter:
    opefo-eval --model_name_or_path runs/lora-adapter --benchmarks aime24 --num_samples 64 \\
        --pass_at_k 8 16 32 64 --output_dir runs/lora-adapter/eval-aime24
    # A local benchmark file, on CPU with transformers:
    opefo-eval --model_name_or_path ./tiny --benchmarks data/my_bench.jsonl --question_column question \\
        --answer_column answer --num_samples 4 --max_new_tokens 256 --backend transformers

    >>> from opefo_trl.cli.evaluate import main
    >>> main(["--model_name_or_path", "runs/opefo-7b", "--benchmarks", "aime24"])  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

PROG = "opefo-eval"


def make_parser():
    from trl import TrlParser

    from opefo_trl.evaluation import EvaluationConfig

    return TrlParser(dataclass_types=[EvaluationConfig], prog=PROG, description=__doc__.split("\n\n")[0])


def main(argv: Sequence[str] | None = None) -> int:
    """Parse options, evaluate, print the markdown table; return the exit status (2 for bad input)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = make_parser()
    try:
        (config,) = parser.parse_args_and_config(args=argv, fail_with_unknown_args=True)
    except (ValueError, FileNotFoundError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2

    from opefo_trl.evaluation import evaluate

    try:
        results = evaluate(config)
    except (ValueError, FileNotFoundError, ImportError) as err:
        print(f"{PROG}: error: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    print(results["markdown"])
    print(f"\nResults written to {config.output_dir} (results.json, results.md, samples.jsonl).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
