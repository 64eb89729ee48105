"""Step time and peak memory of OPEFOTrainer's methods against TRL's strict on-policy GRPOTrainer, in one process.

    python benchmarks/bench_step.py                 # tiny Qwen2 shape, Qwen vocabulary (151,936), 128-token completions
    python benchmarks/bench_step.py --steps 3 --repeats 1 --vocab-size 4096   # a quick look

Each configuration is built from the same saved model and trained for `--steps` optimizer steps (the first is a
warm-up and not timed); configurations are interleaved over `--repeats` rounds so drift hits all alike. Reported
per configuration: median seconds per optimizer step (generation included, as a user experiences it), the same
without the time spent sampling completions (TRL's `_generate`, identical code for every method), peak
memory above the level at the start of the run (CUDA allocator peak on GPU; sampled malloc heap on CPU), the number
of backbone passes per optimizer step other than single-token decoding (prefill + scoring), and each as a ratio to
the GRPOTrainer run of the same batch layout.
Then the `full` estimate's vocabulary pass is timed against a plain logsumexp over the same hidden states and head.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import statistics
import sys
import tempfile
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from opefo_trl import OPEFOConfig, OPEFOTrainer  # noqa: E402
from opefo_trl.tiny import build_tiny_model  # noqa: E402
from opefo_trl.vocab_stats import vocab_stats  # noqa: E402


def length_reward(completions, **kwargs):
    return [float(len(c[0]["content"]) % 3) for c in completions]


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _heap_in_use() -> int:
    """Bytes currently allocated through malloc (arena + mmap'd blocks): unlike RSS it falls when tensors are freed."""
    info = _LIBC.mallinfo2()
    return info.uordblks + info.hblkhd


_LIBC = ctypes.CDLL(ctypes.util.find_library("c"))
_LIBC.mallinfo2.restype = _MallInfo2


class PeakMemory:
    """Peak memory above the starting level: CUDA allocator stats on GPU, a 1 ms malloc-heap sampler on CPU."""

    def __init__(self):
        self.cuda = torch.cuda.is_available()

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
        else:
            self.start = self.peak = _heap_in_use()
            self.running = True
            self.thread = threading.Thread(target=self._sample, daemon=True)
            self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, _heap_in_use())
            time.sleep(0.001)

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
        else:
            self.running = False
            self.thread.join()
        self.bytes = self.peak - self.start


class StepTimer(TrainerCallback):
    def __init__(self):
        self.times, self.begin = [], None

    def on_step_begin(self, args, state, control, **kwargs):
        self.begin = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self.begin)


def configurations(accumulation: int):
    """(name, trainer class, extra config) per run; the first is the baseline of the group."""
    return [
        ("GRPOTrainer (strict)", GRPOTrainer, {}),
        ("opefo", OPEFOTrainer, dict(method="opefo")),
        ("opefo, full estimate", OPEFOTrainer, dict(method="opefo", entropy_flow_estimate="full")),
        ("grpo + diagnostics", OPEFOTrainer, dict(method="grpo")),
        ("clip_cov", OPEFOTrainer, dict(method="clip_cov")),
        ("kl_cov", OPEFOTrainer, dict(method="kl_cov")),
        ("par", OPEFOTrainer, dict(method="par")),
    ]


def run(model_path, dataset, trainer_class, extra, args_ns, accumulation, output_dir):
    settings = dict(
        output_dir=output_dir,
        per_device_train_batch_size=args_ns.completions // accumulation,
        gradient_accumulation_steps=accumulation,
        num_generations=args_ns.num_generations,
        max_completion_length=args_ns.completion_length,
        max_steps=args_ns.steps,
        logging_steps=1,
        bf16=torch.cuda.is_available(),
        use_cpu=not torch.cuda.is_available(),
        report_to="none",
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        gradient_checkpointing=False,
    )
    config_class = OPEFOConfig if trainer_class is OPEFOTrainer else GRPOConfig
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = config_class(**settings, **extra)
        timer = StepTimer()
        trainer = trainer_class(
            model=model_path, reward_funcs=length_reward, args=config, train_dataset=dataset, callbacks=[timer]
        )
    forwards = [0]
    core = trainer.accelerator.unwrap_model(trainer.model)
    core.base_model.register_forward_hook(lambda *a: forwards.__setitem__(0, forwards[0] + 1))
    # Generation calls the backbone once per decoded token; count only scoring passes (inputs longer than 1 token).
    generation_calls = [0]

    def count_generation(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and ids.shape[-1] == 1:
            generation_calls[0] += 1

    core.base_model.register_forward_pre_hook(count_generation, with_kwargs=True)
    # Time inside TRL's sampling (`_generate`): the rest of a step is the part OPEFO can change.
    sampling_times = []
    generate = trainer._generate

    def timed_generate(*args, **kwargs):
        start = time.perf_counter()
        try:
            return generate(*args, **kwargs)
        finally:
            sampling_times.append(time.perf_counter() - start)

    trainer._generate = timed_generate
    with PeakMemory() as memory:
        trainer.train()
    timed = timer.times[1:] or timer.times
    sampling = sampling_times[1:] or sampling_times
    scoring_forwards = (forwards[0] - generation_calls[0]) / args_ns.steps
    return (
        statistics.median(timed),
        memory.bytes,
        scoring_forwards,
        statistics.median(timed) - statistics.median(sampling),
    )


def bench_vocab_pass(hidden_size: int, vocab: int, tokens: int, repeats: int = 5):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=gen).to(device, dtype)
    weight = (torch.randn(vocab, hidden_size, generator=gen) * 0.02).to(device, dtype)

    def plain():
        return torch.logsumexp((hidden @ weight.T).float(), -1)

    def stats():
        return vocab_stats(hidden, weight)

    def timed(fn):
        fn()
        best = float("inf")
        for _ in range(repeats):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        return best

    return timed(plain), timed(stats)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab-size", type=int, default=151_936)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--completion-length", type=int, default=128)
    parser.add_argument("--completions", type=int, default=8, help="completions per optimizer step (per device)")
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run (the first is not timed)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--accumulation", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--vocab-pass-hidden-size", type=int, default=896, help="Qwen2.5-0.5B's hidden size")
    parser.add_argument("--vocab-pass-tokens", type=int, default=512)
    args = parser.parse_args(argv)

    torch.set_num_threads(max(1, torch.get_num_threads()))
    work = tempfile.mkdtemp(prefix="opefo-bench-")
    model_path = build_tiny_model(
        os.path.join(work, "model"),
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        max_position_embeddings=args.completion_length + 64,
    )
    prompts = [{"prompt": [{"role": "user", "content": f"What is {i} + {i + 3}?"}]} for i in range(64)]
    dataset = Dataset.from_list(prompts)
    device = "cuda" if torch.cuda.is_available() else f"cpu ({torch.get_num_threads()} threads)"
    print(
        f"device: {device}; vocab {args.vocab_size}, hidden {args.hidden_size}, {args.completions} completions x "
        f"{args.completion_length} tokens per optimizer step, {args.steps} steps x {args.repeats} repeats\n"
    )

    for accumulation in args.accumulation:
        configs = configurations(accumulation)
        results = {name: [] for name, _, _ in configs}
        # One discarded run first: lazy initialisation and first-touch allocations would otherwise land on the baseline.
        run(model_path, dataset, configs[0][1], configs[0][2], args, accumulation, os.path.join(work, "out"))
        for _ in range(args.repeats):
            for name, trainer_class, extra in configs:
                results[name].append(
                    run(model_path, dataset, trainer_class, extra, args, accumulation, os.path.join(work, "out"))
                )
        base_time = statistics.median(r[0] for r in results[configs[0][0]])
        base_memory = statistics.median(r[1] for r in results[configs[0][0]])
        base_forwards = results[configs[0][0]][0][2]
        print(f"gradient_accumulation_steps={accumulation}")
        base_train = statistics.median(r[3] for r in results[configs[0][0]])
        print(
            "| configuration | s / step | time ratio | s / step without sampling | ratio without sampling | "
            "peak MiB | memory ratio | backbone passes / step besides decoding (vs GRPO) |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for name, _, _ in configs:
            step_time = statistics.median(r[0] for r in results[name])
            memory = statistics.median(r[1] for r in results[name])
            train_time = statistics.median(r[3] for r in results[name])
            forwards = results[name][0][2]
            print(
                f"| {name} | {step_time:.3f} | {step_time / base_time:.3f} | {train_time:.3f} | "
                f"{train_time / base_train:.3f} | {memory / 2**20:.0f} | {memory / max(base_memory, 1):.3f} | "
                f"{forwards:.0f} ({forwards - base_forwards:+.0f}) |"
            )
        print()

    plain, stats = bench_vocab_pass(args.vocab_pass_hidden_size, args.vocab_size, args.vocab_pass_tokens)
    print(
        f"vocabulary pass ({args.vocab_pass_tokens} tokens x hidden {args.vocab_pass_hidden_size} x vocab "
        f"{args.vocab_size}): logsumexp {plain * 1e3:.1f} ms, vocab_stats {stats * 1e3:.1f} ms, "
        f"ratio {stats / plain:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
