"""`opefo-eval`: sample a model on math benchmarks and report avg@n, maj@n and pass@k (also `python -m
opefo_trl.cli.evaluate`).

Every field of `opefo_trl.eval.EvaluationConfig` is a flag (`--help` lists them); `--config eval.yaml` reads them
from a YAML file and command-line flags override it, parsed as `opefo-train` parses its options
(`opefo_trl.cli.options`): an unknown or misspelt key is an error naming the closest options. The prompt template and
`math_reward_mode` not given are those the run was trained with, as its model folder records them
(`opefo_run_options.json`, written by `opefo-train`), else `qwen_math_boxed` and `equivalent`; one line says which.
Wrong input (unknown benchmark, one that cannot be downloaded, missing column, missing model path, pass@k with k > n)
is reported before the model is loaded, as `opefo-eval: error: ...` with exit status 2, as is a full disk (saying what
was kept). Re-running the same command resumes an interrupted run from `OUTPUT_DIR/samples.jsonl`.

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

from opefo_trl._extras import require_extra
from opefo_trl.cli.options import INPUT_ERRORS, build_parser, parse_options, report_error

PROG = "opefo-eval"


def make_parser():
    """The parser over `EvaluationConfig`: see `opefo_trl.cli.options`."""
    from opefo_trl.eval import EvaluationConfig

    return build_parser([EvaluationConfig], prog=PROG, description=__doc__.split("\n\n")[0])


def main(argv: Sequence[str] | None = None) -> int:
    """Parse options, evaluate, print the markdown table; return the exit status (2 for bad input)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        (config,) = parse_options(make_parser(), argv)
        require_extra("math", "math_verify", f"{PROG} (scoring answers)")  # before any model loads
    except INPUT_ERRORS as err:
        return report_error(PROG, err)
    print(config.prompt_and_reward_source, flush=True)

    from opefo_trl.eval import evaluate
    from opefo_trl.eval.store import StoreWriteError

    try:
        results = evaluate(config)
    except (*INPUT_ERRORS, StoreWriteError) as err:  # a full disk too: no traceback
        return report_error(PROG, err)
    print(results["markdown"])
    print(f"\nResults written to {config.output_dir} (results.json, results.md, samples.jsonl).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
