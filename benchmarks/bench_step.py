"""Step time and peak memory of OPEFOTrainer's methods against TRL's strict on-policy GRPOTrainer, in one process.

    python benchmarks/bench_step.py                 # tiny Qwen2 shape, Qwen vocabulary (151,936), 128-token completions
    python benchmarks/bench_step.py --steps 3 --repeats 1 --vocab_size 4096   # a quick look
    python benchmarks/bench_step.py --configs grpo_strict opefo opefo_param --output_json bench.json
    python benchmarks/bench_step.py --real_model --completion_length 64   # SmolLM2-135M-Instruct (make test-real)

Each configuration is built from the same saved model and trained for `--steps` optimizer steps (the first is a
warm-up and not timed); configurations are interleaved over `--repeats` rounds so drift hits all alike. Reported
per configuration: median seconds per optimizer step (generation included, as a user experiences it), the same
without the time spent sampling completions (TRL's `_generate`, identical code for every method), peak memory above
the level at the start of the run (CUDA allocator peak on GPU; sampled malloc heap on CPU), the number of backbone
passes per optimizer step other than single-token decoding (prefill + scoring), and each as a ratio to the
GRPOTrainer run of the same batch layout. Then the `full` estimate's vocabulary pass is timed against a plain
logsumexp over the same hidden states and head. On a GPU the training runs in bf16 mixed precision over float32
weights (the recipes' setting, and what the `param` estimate needs).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import PrinterCallback, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from opefo_trl import OPEFOConfig, OPEFOTrainer  # noqa: E402
from opefo_trl.cli.options import INPUT_ERRORS, build_parser, parse_options, report_error  # noqa: E402
from opefo_trl.maths.vocab_stats import vocab_stats  # noqa: E402
from opefo_trl.testing import build_tiny_model  # noqa: E402


class Configuration(NamedTuple):
    """A benchmarked setup: the trainer class, its config fields, a LoRA rank (None: full fine-tuning), and the
    configuration its ratios are taken against."""

    trainer: type
    fields: dict
    lora_rank: int | None = None
    baseline: str = "grpo_strict"


#: TRL's colocate vLLM generation (each process its own engine, weights synced before every rollout).
VLLM_COLOCATE = dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3)


#: name -> configuration; the first is the baseline every ratio is taken against.
CONFIGURATIONS = {
    "grpo_strict": Configuration(GRPOTrainer, {}),
    "opefo": Configuration(OPEFOTrainer, dict(method="opefo")),
    "opefo_no_bias": Configuration(OPEFOTrainer, dict(method="opefo", entropy_flow_bias_diagnostics=False)),
    "opefo_centered": Configuration(OPEFOTrainer, dict(method="opefo", entropy_flow_estimate="opefo_centered")),
    "opefo_full": Configuration(OPEFOTrainer, dict(method="opefo", entropy_flow_estimate="full")),
    "opefo_param": Configuration(OPEFOTrainer, dict(method="opefo", entropy_flow_estimate="param")),
    "opefo_param_step": Configuration(
        OPEFOTrainer, dict(method="opefo", entropy_flow_estimate="param", opefo_balance="step")
    ),
    "opefo_param_step_probe2": Configuration(
        OPEFOTrainer,
        dict(method="opefo", entropy_flow_estimate="param", opefo_balance="step", entropy_flow_probe_rollouts=2),
    ),
    "opefo_param_step_task": Configuration(
        OPEFOTrainer,
        dict(
            method="opefo",
            entropy_flow_estimate="param",
            opefo_balance="step",
            entropy_flow_entropy="task_tokens",
            entropy_flow_task_tokens=list(range(18, 28)),  # the tiny tokenizer's digits
        ),
    ),
    "opefo_param_lora16": Configuration(OPEFOTrainer, dict(method="opefo", entropy_flow_estimate="param"), 16),
    "grpo_diagnostics": Configuration(OPEFOTrainer, dict(method="grpo")),
    "clip_cov": Configuration(OPEFOTrainer, dict(method="clip_cov")),
    "kl_cov": Configuration(OPEFOTrainer, dict(method="kl_cov")),
    "par": Configuration(OPEFOTrainer, dict(method="par")),
    "grpo_strict_vllm": Configuration(GRPOTrainer, VLLM_COLOCATE, baseline="grpo_strict_vllm"),
    "opefo_vllm": Configuration(OPEFOTrainer, dict(method="opefo", **VLLM_COLOCATE), baseline="grpo_strict_vllm"),
}
#: The configurations that need vLLM (run by default only where it is installed).
VLLM_CONFIGURATIONS = [name for name, c in CONFIGURATIONS.items() if c.fields.get("use_vllm")]


def default_configurations() -> list[str]:
    import importlib.util

    vllm = importlib.util.find_spec("vllm") is not None
    return [name for name in CONFIGURATIONS if vllm or name not in VLLM_CONFIGURATIONS]


@dataclass
class BenchSettings:
    """What `bench_step.py` measures (the model's shape, the batch, the configurations)."""

    real_model: bool = field(
        default=False,
        metadata={
            "help": "Benchmark the real pretrained SmolLM2-135M-Instruct (opefo_trl.real_model; 30 layers, vocabulary "
            "49,152) instead of a random model; the shape options below are then unused."
        },
    )
    model_path: str | None = field(
        default=None,
        metadata={"help": "Benchmark this local model folder instead of a random model (shape options unused)."},
    )
    vocab_size: int = field(default=151_936, metadata={"help": "Vocabulary of the random model (Qwen's: 151,936)."})
    hidden_size: int = field(default=64, metadata={"help": "Hidden size of the random Qwen2 model."})
    num_layers: int = field(default=2, metadata={"help": "Decoder layers of the random model."})
    num_heads: int = field(default=4, metadata={"help": "Attention heads."})
    num_key_value_heads: int | None = field(default=None, metadata={"help": "Key/value heads (default heads / 2)."})
    intermediate_size: int | None = field(default=None, metadata={"help": "MLP size (default 2 x hidden)."})
    completion_length: int = field(default=128, metadata={"help": "Tokens per completion (max_completion_length)."})
    completions: int = field(default=8, metadata={"help": "Completions per optimizer step (per device)."})
    num_generations: int = field(default=4, metadata={"help": "Completions per prompt (GRPO group size)."})
    steps: int = field(default=3, metadata={"help": "Optimizer steps per run (the first is not timed)."})
    repeats: int = field(default=1, metadata={"help": "Interleaved rounds over the configurations."})
    accumulation: list[int] = field(
        default_factory=lambda: [1, 2], metadata={"help": "gradient_accumulation_steps values to measure."}
    )
    configs: list[str] = field(
        default_factory=default_configurations,
        metadata={
            "help": f"Configurations to run, among {list(CONFIGURATIONS)}; each one's baseline always runs (the "
            f"vLLM ones, {VLLM_CONFIGURATIONS}, by default only where vLLM is installed)."
        },
    )
    gradient_checkpointing: bool = field(default=False, metadata={"help": "Train with gradient checkpointing."})
    discard_first_run: bool = field(
        default=True,
        metadata={"help": "Run the baseline once, untimed, before the measured runs (first-touch allocations)."},
    )
    vocab_pass_hidden_size: int = field(default=896, metadata={"help": "Hidden size of the vocabulary-pass timing."})
    vocab_pass_tokens: int = field(default=512, metadata={"help": "Tokens of the vocabulary-pass timing."})
    output_json: str | None = field(default=None, metadata={"help": "Also write the results to this JSON file."})

    def __post_init__(self):
        unknown = [c for c in self.configs if c not in CONFIGURATIONS]
        if unknown:
            raise ValueError(f"Unknown configuration(s) {unknown}; choose among {list(CONFIGURATIONS)}.")
        baselines = [CONFIGURATIONS[c].baseline for c in self.configs]
        self.configs = list(dict.fromkeys([*baselines, *self.configs]))  # each baseline before what it is compared to
        for name in ("steps", "repeats", "completions", "completion_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.real_model and self.model_path:
            raise ValueError("Give --real_model or --model_path, not both.")
        if self.real_model or self.model_path:
            # Its token ids are the tiny tokenizer's digits: meaningless for another vocabulary.
            self.configs = [c for c in self.configs if c != "opefo_param_step_task"]
        if any(self.completions % a for a in self.accumulation):
            raise ValueError(f"completions ({self.completions}) must be divisible by every accumulation value.")


def length_reward(completions, **kwargs):
    return [float(len(c[0]["content"]) % 3) for c in completions]


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


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
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.begin = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self.begin)


def training_settings(settings: BenchSettings, accumulation: int, output_dir: str) -> dict:
    """The GRPOConfig fields every configuration shares (bf16 autocast over fp32 weights and a float32 LM head on a
    GPU)."""
    cuda = torch.cuda.is_available()
    return dict(
        output_dir=output_dir,
        vllm_max_model_length=settings.completion_length + 64,  # the model's context (build_model)
        per_device_train_batch_size=settings.completions // accumulation,
        gradient_accumulation_steps=accumulation,
        num_generations=settings.num_generations,
        max_completion_length=settings.completion_length,
        max_steps=settings.steps,
        logging_steps=1,
        bf16=cuda,
        cast_lm_head_to_fp32=True,  # the recipes' setting, for every configuration (OPEFOConfig's default)
        use_cpu=not cuda,
        model_init_kwargs={"dtype": "float32"},
        report_to="none",
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        gradient_checkpointing=settings.gradient_checkpointing,
    )


def run(model_path, dataset, name, settings: BenchSettings, accumulation: int, output_dir: str) -> dict:
    """Train one configuration; return its median step time, time without sampling, peak memory and passes."""
    configuration = CONFIGURATIONS[name]
    if configuration.fields.get("use_vllm"):
        _keep_vllm_cpu_weights()
    config_class = OPEFOConfig if configuration.trainer is OPEFOTrainer else GRPOConfig
    peft_config = None
    if configuration.lora_rank is not None:
        from peft import LoraConfig

        rank = configuration.lora_rank
        peft_config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", task_type="CAUSAL_LM")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = config_class(**training_settings(settings, accumulation, output_dir), **configuration.fields)
        timer = StepTimer()
        trainer = configuration.trainer(
            model=model_path,
            reward_funcs=length_reward,
            args=config,
            train_dataset=dataset,
            callbacks=[timer],
            peft_config=peft_config,
        )
    trainer.remove_callback(PrinterCallback)  # disable_tqdm prints every log dict otherwise
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
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            sampling_times.append(time.perf_counter() - start)

    trainer._generate = timed_generate
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with PeakMemory() as memory:
            trainer.train()
    timed = timer.times[1:] or timer.times
    sampling = sampling_times[1:] or sampling_times
    return dict(
        seconds_per_step=statistics.median(timed),
        seconds_without_sampling=statistics.median(timed) - statistics.median(sampling),
        peak_bytes=memory.bytes,
        peak_total_bytes=memory.peak,
        backbone_passes_per_step=(forwards[0] - generation_calls[0]) / settings.steps,
    )


def _keep_vllm_cpu_weights() -> None:
    """On vLLM's CPU build, the test tier's workaround for TRL's colocate weight sync (tests/vllm_cpu_gemm.py: the
    CPU backend prepacks and drops the linear weights TRL loads into); GPU builds need none."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
        import vllm_cpu_gemm

        vllm_cpu_gemm.install()


def compare(model_path, dataset, settings: BenchSettings, work: str, deadline=None, on_run=None) -> dict:
    """Every configuration at every accumulation, interleaved; medians and ratios to the baseline.

    ``deadline`` (a ``time.time()``): a run is skipped, and listed in ``results["skipped"]``, when the previous run's
    duration would take it past the deadline. ``on_run(results)`` is called after every run with the results so far.
    """
    results, last_duration = {}, 0.0

    def fits() -> bool:
        return deadline is None or time.time() + 1.2 * last_duration <= deadline

    for accumulation in settings.accumulation:
        key = f"accumulation_{accumulation}"
        runs = {name: [] for name in settings.configs}
        if settings.discard_first_run and fits():
            # One discarded run first: lazy initialisation and first-touch allocations would otherwise land on the
            # baseline.
            start = time.time()
            run(model_path, dataset, settings.configs[0], settings, accumulation, os.path.join(work, "out"))
            last_duration = time.time() - start
        for _ in range(settings.repeats):
            for name in settings.configs:
                if not fits():
                    results.setdefault("skipped", {}).setdefault(key, []).append(name)
                    continue
                start = time.time()
                runs[name].append(run(model_path, dataset, name, settings, accumulation, os.path.join(work, "out")))
                last_duration = time.time() - start
                results[key] = _medians(runs)
                if on_run is not None:
                    on_run(results)
        results[key] = _medians(runs)
    return results


def _medians(runs: dict) -> dict:
    """Median of each figure over a configuration's runs, and its ratio to the baseline's (when both ran)."""
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items() if rs}
    for name, m in medians.items():
        base = medians.get(CONFIGURATIONS[name].baseline)
        if base is None:
            continue
        m["time_ratio"] = m["seconds_per_step"] / base["seconds_per_step"]
        m["time_ratio_without_sampling"] = m["seconds_without_sampling"] / base["seconds_without_sampling"]
        m["memory_ratio"] = m["peak_bytes"] / max(base["peak_bytes"], 1)
        m["extra_backbone_passes"] = m["backbone_passes_per_step"] - base["backbone_passes_per_step"]
    return medians


def markdown_table(medians: dict) -> str:
    lines = [
        "| configuration | s / step | time ratio | s / step without sampling | ratio without sampling | peak MiB | "
        "memory ratio | backbone passes / step besides decoding (vs GRPO) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, m in medians.items():
        lines.append(
            f"| {name} | {m['seconds_per_step']:.3f} | {_ratio(m, 'time_ratio')} | {m['seconds_without_sampling']:.3f} "
            f"| {_ratio(m, 'time_ratio_without_sampling')} | {m['peak_bytes'] / 2**20:.0f} | "
            f"{_ratio(m, 'memory_ratio')} | {m['backbone_passes_per_step']:.0f} "
            f"({m.get('extra_backbone_passes', float('nan')):+.0f}) |"
        )
    return "\n".join(lines)


def _ratio(medians: dict, key: str) -> str:
    return f"{medians[key]:.3f}" if key in medians else "n/a"


def bench_vocab_pass(hidden_size: int, vocab: int, tokens: int, repeats: int = 5) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=gen).to(device, dtype)
    weight = (torch.randn(vocab, hidden_size, generator=gen) * 0.02).to(device, dtype)

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

    plain = timed(lambda: torch.logsumexp((hidden @ weight.T).float(), -1))
    stats = timed(lambda: vocab_stats(hidden, weight))
    return dict(logsumexp_seconds=plain, vocab_stats_seconds=stats, ratio=stats / plain)


def build_model(settings: BenchSettings, work: str) -> str:
    """The model folder to benchmark: the real model, the given folder, or a random model of the given shape."""
    if settings.real_model:
        from opefo_trl.real_model import smollm2_135m_instruct

        return str(smollm2_135m_instruct())
    if settings.model_path:
        return settings.model_path
    return build_tiny_model(
        os.path.join(work, "model"),
        vocab_size=settings.vocab_size,
        hidden_size=settings.hidden_size,
        num_layers=settings.num_layers,
        num_heads=settings.num_heads,
        num_key_value_heads=settings.num_key_value_heads,
        intermediate_size=settings.intermediate_size,
        max_position_embeddings=settings.completion_length + 64,
    )


def prompts_dataset(size: int = 64) -> Dataset:
    return Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"What is {i} + {i + 3}?"}]} for i in range(size)]
    )


def main(argv=None) -> int:
    parser = build_parser([BenchSettings], prog="bench_step.py", description=__doc__)
    try:
        (settings,) = parse_options(parser, argv)
    except INPUT_ERRORS as err:
        return report_error(parser.prog, err)
    work = tempfile.mkdtemp(prefix="opefo-bench-")
    model_path = build_model(settings, work)
    dataset = prompts_dataset()
    device = "cuda" if torch.cuda.is_available() else f"cpu ({torch.get_num_threads()} threads)"
    from transformers import AutoConfig

    shape = AutoConfig.from_pretrained(model_path)
    print(
        f"device: {device}; model {model_path}: vocab {shape.vocab_size}, hidden {shape.hidden_size}, "
        f"{shape.num_hidden_layers} layers; "
        f"{settings.completions} completions x {settings.completion_length} tokens per optimizer step, "
        f"{settings.steps} steps x {settings.repeats} repeats\n"
    )
    results = compare(model_path, dataset, settings, work)
    for key, medians in results.items():
        if key != "skipped":
            print(f"gradient_accumulation_steps={key.split('_')[-1]}\n{markdown_table(medians)}\n")
    vocab = bench_vocab_pass(settings.vocab_pass_hidden_size, shape.vocab_size, settings.vocab_pass_tokens)
    print(
        f"vocabulary pass ({settings.vocab_pass_tokens} tokens x hidden {settings.vocab_pass_hidden_size} x vocab "
        f"{shape.vocab_size}): logsumexp {vocab['logsumexp_seconds'] * 1e3:.1f} ms, vocab_stats "
        f"{vocab['vocab_stats_seconds'] * 1e3:.1f} ms, ratio {vocab['ratio']:.3f}"
    )
    if settings.output_json:
        with open(settings.output_json, "w") as f:
            json.dump(
                {"settings": asdict(settings), "device": device, "steps": results, "vocab_pass": vocab}, f, indent=2
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
