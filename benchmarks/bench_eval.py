"""Samples per second of opefo-eval's batched transformers backend vs a one-prompt-at-a-time `model.generate` loop.

Both draw the same number of samples (prompts x n) of the same random Qwen2-shaped model (default hidden 256, 4
layers) with temperature 1.0 and top-p 0.7:

- batched: `opefo_trl.eval.TransformersBackend`, `--batch_size` sequences (several prompts x n samples) per
  `generate` call, left padded, per-sample seeds;
- loop: one `model.generate(..., do_sample=True, num_return_sequences=n)` call per prompt;
- loop, single sequences: one call per sample (`--single`; the most naive loop).

The random model rarely emits an end-of-sequence token, so nearly every sample runs to `--max_new_tokens` in both.
Offline, CPU by default (GPU if visible). Prints samples/s, tokens/s and the speed-up (target: >= 2x).

    python benchmarks/bench_eval.py
    python benchmarks/bench_eval.py --num_prompts 32 --num_samples 8 --max_new_tokens 128 --single
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@dataclass
class BenchEvalArguments:
    """Options of this benchmark (every field is a `--flag`)."""

    hidden_size: int = field(default=256, metadata={"help": "Hidden size of the random Qwen2-shaped model."})
    num_layers: int = field(default=4, metadata={"help": "Layers of the model."})
    num_prompts: int = field(default=16, metadata={"help": "Prompts to sample."})
    num_samples: int = field(default=4, metadata={"help": "Samples per prompt (n)."})
    max_new_tokens: int = field(default=64, metadata={"help": "Tokens per sample."})
    batch_size: int = field(default=64, metadata={"help": "Sequences per generate call (batched backend)."})
    single: bool = field(default=False, metadata={"help": "Also time a one-sample-per-call loop."})
    model_dir: str | None = field(default=None, metadata={"help": "Where to build the model (default: a temp dir)."})


def parse_args(argv=None) -> BenchEvalArguments:
    """The options, parsed like opefo-train's and opefo-eval's (unknown flags refused with the closest names)."""
    from opefo_trl.cli.options import build_parser, parse_options

    parser = build_parser([BenchEvalArguments], prog="bench_eval.py", description=__doc__.split("\n\n")[0])
    (args,) = parse_options(parser, argv)
    return args


def main(argv=None):
    args = parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opefo_trl.eval import EvaluationConfig, Problem, SampleJob, TransformersBackend, build_prompt_ids, sample_seed
    from opefo_trl.testing import build_tiny_model

    model_dir = args.model_dir or os.path.join(
        tempfile.gettempdir(), f"opefo-bench-eval-{args.hidden_size}-{args.num_layers}"
    )
    build_tiny_model(model_dir, hidden_size=args.hidden_size, num_layers=args.num_layers)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    config = EvaluationConfig(
        model_name_or_path=model_dir,
        benchmarks=["bench.jsonl"],
        num_samples=args.num_samples,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        temperature=1.0,
        top_p=0.7,
        backend="transformers",
    )
    problems = [Problem(i, f"What is {i + 3} + {2 * i + 5}?", str(3 * i + 8)) for i in range(args.num_prompts)]
    prompt_ids = build_prompt_ids(tokenizer, problems, config.prompt_template)
    jobs = [
        SampleJob(
            "bench", p.problem_id, s, p.fingerprint, tuple(ids), sample_seed(config.seed, "bench", p.problem_id, s)
        )
        for p, ids in zip(problems, prompt_ids, strict=True)
        for s in range(args.num_samples)
    ]
    total = len(jobs)
    print(
        f"model hidden={args.hidden_size} layers={args.num_layers} on {device} ({torch.get_num_threads()} threads); "
        f"{args.num_prompts} prompts x {args.num_samples} samples = {total}, max_new_tokens={args.max_new_tokens}"
    )

    backend = TransformersBackend(model, tokenizer, config)
    # Warm-up (first-call allocations), not timed.
    next(backend.run(jobs[:2]))
    model.generate(
        input_ids=torch.tensor([prompt_ids[0]], device=device),
        max_new_tokens=4,
        do_sample=True,
        pad_token_id=backend.pad_id,
    )

    start = time.perf_counter()
    batched_tokens = sum(s.num_tokens for _, samples in backend.run(jobs) for s in samples)
    batched_s = time.perf_counter() - start

    def loop(num_return_sequences, calls_per_prompt):
        tokens = 0
        start = time.perf_counter()
        for ids in prompt_ids:
            input_ids = torch.tensor([ids], device=device)
            for _ in range(calls_per_prompt):
                with torch.inference_mode():
                    out = model.generate(
                        input_ids=input_ids,
                        attention_mask=torch.ones_like(input_ids),
                        do_sample=True,
                        temperature=1.0,
                        top_p=0.7,
                        top_k=0,
                        max_new_tokens=args.max_new_tokens,
                        num_return_sequences=num_return_sequences,
                        eos_token_id=backend.eos_ids,
                        pad_token_id=backend.pad_id,
                    )
                new = out[:, input_ids.shape[1] :]
                for row in new.tolist():
                    end = next((i for i, t in enumerate(row) if t in backend.eos_ids), None)
                    tokens += len(row) if end is None else end + 1
        return time.perf_counter() - start, tokens

    loop_s, loop_tokens = loop(args.num_samples, 1)
    rows = [
        ("batched backend", batched_s, batched_tokens),
        ("one prompt per generate call", loop_s, loop_tokens),
    ]
    if args.single:
        single_s, single_tokens = loop(1, args.num_samples)
        rows.append(("one sample per generate call", single_s, single_tokens))

    print(f"{'method':32s} {'seconds':>8s} {'samples/s':>10s} {'tokens/s':>10s}")
    for name, seconds, tokens in rows:
        print(f"{name:32s} {seconds:8.2f} {total / seconds:10.2f} {tokens / seconds:10.1f}")
    ratio = loop_s / batched_s
    print(
        f"speed-up (samples/s) batched vs one prompt per call: {ratio:.2f}x  "
        f"(target >= 2x: {'PASS' if ratio >= 2 else 'FAIL'})"
    )
    if args.single:
        print(f"speed-up batched vs one sample per call: {rows[2][1] / batched_s:.2f}x")
    return ratio


if __name__ == "__main__":
    main()
