"""The GPU check: what a first GPU run depends on, in stages (run it through `benchmarks/gpu_check.sh`).

0. environment: versions and where each package was imported from, the GPU, TF32 / matmul precision settings,
   whether TRL's Triton kernels are used (and a fused-LM-head smoke test against torch), `import deepspeed`;
1. precision (`benchmarks/precision.py`): a Qwen2.5-0.5B-shaped model warm-started to peaked distributions; lambda*,
   P, N and per-token signs of the `opefo` and `full` estimates in fp32, bf16 autocast, pure bf16 weights and with
   TRL's fp32 LM head, against float64; through OPEFOTrainer, the `param` estimate's check error and predicted vs
   measured entropy change at lr 1e-5, and the audit's noise floor at lr 0 in bf16;
2. ZeRO-3 on one GPU through the real path, `accelerate launch --config_file recipes/accelerate/zero3.yaml
   --num_processes 1 -m opefo_trl.cli.train --config recipes/qwen2.5-math-7b/opefo.yaml` with a local model (random,
   Qwen2.5-0.5B's shape) and data, `--use_vllm false`: accumulation 2, 3 steps, a checkpoint, the audit every step;
   a 1-step resume (`--resume_from_checkpoint true`); the `full` estimate at accumulation 1 (the gathered, tied head).
   Exit codes, s/step, peak device memory, lambda*, measured change, grad norm, checkpoint files;
3. cost (`benchmarks/bench_step.py`) with gradient checkpointing on: GRPO, `opefo`, `full`, `param` and `param` with
   `opefo_balance="step"`, accumulation 2, 0.5B shape, 32 x 256 tokens; peak memory at 1.5B shape (hidden 1536, 28
   layers) for GRPO, `full`, `param` and `param` + LoRA r16.

Each stage runs in its own subprocess with its own timeout, writing OUTPUT_DIR/stageN.json (as it goes) and
OUTPUT_DIR/stageN.log, so a failing stage does not stop the next. A global deadline (`--deadline_s`) caps every
stage's timeout by the time left, so the last stage shrinks (it skips the runs that would not finish). The markdown
report (every stage's figures, from the stageN.json files in OUTPUT_DIR) is printed at the end.

`--reduced true` runs every stage small on a CPU (tiny models, fp32 training, DeepSpeed through gloo with the
shared-memory kernel build skipped): what `make test` runs, so the script is known to work before a GPU is lent.

    bash benchmarks/gpu_check.sh OUT                 # all stages, about 8.5 minutes on one H200
    bash benchmarks/gpu_check.sh OUT --stages 2      # rerun stage 2 alone (the report keeps the others)
    python benchmarks/gpu_check.py --output_dir OUT --reduced true   # the CPU reduced mode
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field

BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCHMARKS)
sys.path.insert(0, BENCHMARKS)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

STAGES = {0: "environment", 1: "precision", 2: "zero3", 3: "cost"}
#: Seconds per stage before the global deadline caps them (the last stage usually meets the deadline first).
TIMEOUTS = {0: 90, 1: 210, 2: 210, 3: 600}
#: Time a stage keeps for itself at the end of its timeout: it skips work that would start after that.
STAGE_MARGIN_S = 20
ZERO3_CONFIG = os.path.join("recipes", "accelerate", "zero3.yaml")
RECIPE = os.path.join("recipes", "qwen2.5-math-7b", "opefo.yaml")
#: Model shapes (Qwen2.5's; `tiny` for the reduced mode).
SHAPES = {
    "0.5b": dict(hidden_size=896, num_layers=24, num_heads=14, num_key_value_heads=2, intermediate_size=4864),
    "1.5b": dict(hidden_size=1536, num_layers=28, num_heads=12, num_key_value_heads=2, intermediate_size=8960),
    "tiny": dict(hidden_size=32, num_layers=2, num_heads=4, num_key_value_heads=2, intermediate_size=64),
}
QWEN_VOCAB = 151_936


@dataclass
class GpuCheckSettings:
    """What the GPU check runs and where it writes."""

    output_dir: str = field(default="gpu-check", metadata={"help": "Where stageN.json and stageN.log go."})
    stages: list[int] = field(default_factory=lambda: list(STAGES), metadata={"help": "Stages to run, in order."})
    reduced: bool = field(
        default=False, metadata={"help": "Every stage small on a CPU (tiny models, fp32 training): the test mode."}
    )
    deadline_s: float = field(
        default=510.0, metadata={"help": "Seconds for the whole check; each stage's timeout is capped by what is left."}
    )
    timeouts: list[str] = field(
        default_factory=list,
        metadata={"help": f"Per-stage timeouts as STAGE=SECONDS (defaults {TIMEOUTS}), e.g. --timeouts 1=300."},
    )
    work_dir: str = field(
        default=os.path.join(tempfile.gettempdir(), "opefo-gpu-check"),
        metadata={"help": "Models, data and run folders (large; not under output_dir). Builds are reused."},
    )
    report: str | None = field(default=None, metadata={"help": "Also write the markdown report to this file."})
    run_stage: int | None = field(default=None, metadata={"help": "Internal: run this one stage in this process."})
    stage_deadline: float | None = field(default=None, metadata={"help": "Internal: the stage's time.time() limit."})

    def __post_init__(self):
        unknown = [s for s in self.stages if s not in STAGES]
        if unknown or not self.stages:
            raise ValueError(f"Unknown stage(s) {unknown or self.stages}; choose among {STAGES}.")
        self.timeout_by_stage = dict(TIMEOUTS)
        for item in self.timeouts:
            stage, sep, seconds = item.partition("=")
            try:
                stage_number, value = int(stage), float(seconds)
            except ValueError:
                stage_number, value = None, None
            if not sep or stage_number not in STAGES or value is None or value <= 0:
                raise ValueError(f"--timeouts takes STAGE=SECONDS with a stage in {list(STAGES)}; got {item!r}.")
            self.timeout_by_stage[stage_number] = value
        if self.deadline_s <= 0:
            raise ValueError(f"deadline_s must be positive, got {self.deadline_s}.")
        # The stages run with the repository as working directory.
        self.output_dir, self.work_dir = os.path.abspath(self.output_dir), os.path.abspath(self.work_dir)


# ----------------------------------------------------------------------------------------------------------------------
# Orchestration
# ----------------------------------------------------------------------------------------------------------------------


def stage_path(output_dir: str, stage: int, ext: str = "json") -> str:
    return os.path.join(output_dir, f"stage{stage}.{ext}")


def write_json(path: str, data: dict) -> None:
    """Atomically (a partly written file never replaces a whole one)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, default=str)
    os.replace(tmp, path)


def read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _stage_command(check: GpuCheckSettings, stage: int, deadline: float) -> list[str]:
    return [
        sys.executable, os.path.abspath(__file__), "--run_stage", str(stage), "--output_dir", check.output_dir,
        "--reduced", str(check.reduced).lower(), "--work_dir", check.work_dir, "--stage_deadline", f"{deadline:.3f}",
    ]  # fmt: skip


def run_stages(check: GpuCheckSettings) -> dict[int, dict]:
    """Run each stage in a subprocess of its own (own process group, own timeout); record its outcome."""
    os.makedirs(check.output_dir, exist_ok=True)
    deadline = time.time() + check.deadline_s
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if check.reduced:
        env.setdefault("OMP_NUM_THREADS", "1")  # tiny models: threads only contend
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    outcomes = {}
    for stage in check.stages:
        left = deadline - time.time()
        timeout = min(check.timeout_by_stage[stage], left)
        path = stage_path(check.output_dir, stage)
        if os.path.exists(path):
            os.remove(path)  # a stale result must not pass for this run's
        record = dict(stage=stage, name=STAGES[stage], timeout_s=round(timeout, 1), reduced=check.reduced)
        if left < 5:
            record.update(status="skipped", reason="global deadline reached")
            write_json(path, record)
            outcomes[stage] = record
            print(f"stage {stage} ({STAGES[stage]}): skipped, global deadline reached", flush=True)
            continue
        print(f"stage {stage} ({STAGES[stage]}): timeout {timeout:.0f} s ...", flush=True)
        start, cpu_before = time.time(), _children_cpu_seconds()
        command = _stage_command(check, stage, start + max(timeout - STAGE_MARGIN_S, timeout / 2))
        with open(stage_path(check.output_dir, stage, "log"), "w") as log:
            process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True
            )
            try:
                exit_code = process.wait(timeout=timeout)
                status = "ok" if exit_code == 0 else "failed"
            except subprocess.TimeoutExpired:
                _kill_group(process)
                exit_code, status = None, "timeout"
        partial = read_json(path) or {}  # what the stage wrote before it ended
        record.update(results=partial.get("results", {}), **({"error": partial["error"]} if "error" in partial else {}))
        record.update(
            status=status,
            exit_code=exit_code,
            seconds=round(time.time() - start, 1),
            cpu_seconds=round(_children_cpu_seconds() - cpu_before, 1),
        )
        if status != "ok":
            record["log_tail"] = _tail(stage_path(check.output_dir, stage, "log"))
        write_json(path, record)
        outcomes[stage] = record
        print(f"stage {stage} ({STAGES[stage]}): {status} in {record['seconds']:.0f} s", flush=True)
    return outcomes


def _children_cpu_seconds() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _kill_group(process: subprocess.Popen) -> None:
    """SIGTERM the stage's process group (its launches too), then SIGKILL what is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: str, chars: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return ""


class StageRecorder:
    """A stage's results, written to stageN.json after every part (a stage killed at its timeout keeps them)."""

    def __init__(self, check: GpuCheckSettings, stage: int):
        self.path = stage_path(check.output_dir, stage)
        self.record = dict(stage=stage, name=STAGES[stage], status="running", results={})
        self.save()

    @property
    def results(self) -> dict:
        return self.record["results"]

    def save(self) -> None:
        write_json(self.path, self.record)

    def update(self, **parts) -> None:
        self.results.update(parts)
        self.save()


# ----------------------------------------------------------------------------------------------------------------------
# Stage 0: environment
# ----------------------------------------------------------------------------------------------------------------------

PACKAGES = (
    "torch", "transformers", "trl", "accelerate", "datasets", "peft", "deepspeed", "math_verify",
    "latex2sympy2_extended", "pydantic", "huggingface_hub", "tokenizers", "safetensors", "pyarrow", "fsspec", "triton",
    "opefo_trl",
)  # fmt: skip


def stage_environment(check: GpuCheckSettings, recorder: StageRecorder) -> None:
    import importlib

    import torch

    packages = {}
    for name in PACKAGES:
        try:
            module = importlib.import_module(name)
            packages[name] = dict(version=getattr(module, "__version__", "?"), path=os.path.dirname(module.__file__))
        except Exception as err:  # an import failure is the finding
            packages[name] = dict(error=f"{type(err).__name__}: {err}")
    recorder.update(python=sys.version.split()[0], platform=platform.platform(), packages=packages)
    cuda = torch.cuda.is_available()
    gpu = dict(cuda_available=cuda, torch_cuda=torch.version.cuda)
    if cuda:
        props = torch.cuda.get_device_properties(0)
        gpu.update(
            name=props.name,
            capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
            bf16_supported=torch.cuda.is_bf16_supported(),
            driver=_nvidia_smi("driver_version"),
        )
    recorder.update(
        gpu=gpu,
        precision_settings=dict(
            float32_matmul_precision=torch.get_float32_matmul_precision(),
            cuda_matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32,
            cudnn_allow_tf32=torch.backends.cudnn.allow_tf32,
            cuda_matmul_allow_bf16_reduced_precision=torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        ),
        env={k: os.environ.get(k) for k in ("DS_BUILD_OPS", "PYTHONPATH", "HF_HUB_OFFLINE", "OMP_NUM_THREADS")},
    )
    try:
        from trl.kernels import chunked_logprob

        device = torch.device("cuda" if cuda else "cpu")
        recorder.update(trl_kernels=dict(triton_available=chunked_logprob._TRITON_AVAILABLE,
                                         used_on_device=chunked_logprob._use_triton(device)))  # fmt: skip
        recorder.update(fused_head_smoke=_fused_head_smoke(device))
    except Exception as err:
        recorder.update(trl_kernels=dict(error=f"{type(err).__name__}: {err}"))
    try:
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        recorder.update(deepspeed=dict(version=deepspeed.__version__, accelerator=get_accelerator()._name))
    except Exception as err:
        recorder.update(deepspeed=dict(error=f"{type(err).__name__}: {err}"))
    failed = [name for name, info in packages.items() if "error" in info and name not in ("triton",)]
    if failed:
        raise RuntimeError(f"import failed: {failed}")


def _nvidia_smi(query: str) -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20,
        )  # fmt: skip
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def _fused_head_smoke(device) -> dict:
    """TRL's chunked log-prob / entropy against torch's log_softmax (fp32, 256 tokens, 40,000 vocab)."""
    import torch
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(256, 64, generator=gen).to(device)
    weight = (torch.randn(40_000, 64, generator=gen) * 0.3).to(device)
    targets = torch.randint(40_000, (256,), generator=gen).to(device)
    with torch.no_grad():
        logps, entropy, *_ = ChunkedLogProbFunction.apply(hidden, weight, None, targets, 1.0, 8192, None, 1.0,
                                                          ("entropy",))  # fmt: skip
        reference = torch.log_softmax((hidden.double() @ weight.double().T), -1)
    return dict(
        max_logp_abs_error=float((logps.double() - reference.gather(1, targets[:, None])[:, 0]).abs().max()),
        max_entropy_abs_error=float((entropy.double() + (reference.exp() * reference).sum(-1)).abs().max()),
    )


# ----------------------------------------------------------------------------------------------------------------------
# Stage 1: precision
# ----------------------------------------------------------------------------------------------------------------------


def precision_settings(check: GpuCheckSettings):
    from precision import PrecisionSettings

    work = os.path.join(check.work_dir, "precision")
    if check.reduced:
        return PrecisionSettings(
            output_dir=check.output_dir, work_dir=work, vocab_size=1024, **SHAPES["tiny"], chain_states=64,
            max_successors=16, warm_start_steps=30, warm_start_batch=8, warm_start_positions=16,
            warm_start_lr=1e-2, completions=16, num_generations=4, completion_length=16, block_completions=8,
            trainer_completions=4, trainer_num_generations=2, trainer_completion_length=8, trainer_steps=2,
            trainer_bf16=False,
        )  # fmt: skip
    return PrecisionSettings(
        output_dir=check.output_dir, work_dir=work, vocab_size=QWEN_VOCAB, **SHAPES["0.5b"], chain_states=64,
        warm_start_steps=300, warm_start_batch=16, warm_start_positions=128, warm_start_lr=1e-3, completions=32,
        num_generations=8, completion_length=128, block_completions=8, trainer_completions=16,
        trainer_num_generations=8, trainer_completion_length=128, trainer_steps=3, trainer_bf16=True,
    )  # fmt: skip


def stage_precision(check: GpuCheckSettings, recorder: StageRecorder) -> None:
    import precision

    def save(report):
        recorder.results.clear()
        recorder.update(**report)

    precision.run(precision_settings(check), save, deadline=check.stage_deadline)


# ----------------------------------------------------------------------------------------------------------------------
# Stage 2: DeepSpeed ZeRO-3 through accelerate launch and opefo-train
# ----------------------------------------------------------------------------------------------------------------------

#: Run by `accelerate launch` in the reduced (CPU) mode instead of `-m opefo_trl.cli.train`: DeepSpeed's CPU backend
#: would first JIT-compile a shared-memory kernel used only for inference (~1 min, needs a C++ compiler); training
#: collectives go through gloo either way.
CPU_LAUNCHER = """
import sys

import deepspeed.ops

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

from opefo_trl.cli.train import main

sys.exit(main(sys.argv[1:]))
"""


class PeakMemory(threading.Thread):
    """Polls the memory in use while a launch runs: the GPU's (nvidia-smi, CUDA context and allocator cache
    included), else the resident memory of the process tree."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak, self.running = pid, 0, True
        import torch

        self.gpu = torch.cuda.is_available()

    def run(self):
        import psutil

        while self.running:
            try:
                if self.gpu:
                    used = _nvidia_smi("memory.used")
                    current = int(float(used)) * 2**20 if used else 0
                else:
                    root = psutil.Process(self.pid)
                    current = sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
                self.peak = max(self.peak, current)
            except (psutil.Error, ValueError):
                pass
            time.sleep(0.5)


def zero3_plan(check: GpuCheckSettings, runs_dir: str) -> list[tuple[str, str, list[str]]]:
    """(name, output_dir, extra options) of the three launches: train + checkpoint, resume, `full` at accumulation 1."""
    batch = 4 if check.reduced else 8
    trained, full = os.path.join(runs_dir, "opefo"), os.path.join(runs_dir, "full")
    every_step = ["--entropy_flow_audit_steps", "1", "--save_steps", "3"]
    return [
        ("train", trained, ["--gradient_accumulation_steps", "2", "--per_device_train_batch_size", str(batch),
                            "--max_steps", "3", *every_step]),
        ("resume", trained, ["--gradient_accumulation_steps", "2", "--per_device_train_batch_size", str(batch),
                             "--max_steps", "4", "--resume_from_checkpoint", "true", *every_step]),
        ("full", full, ["--gradient_accumulation_steps", "1", "--per_device_train_batch_size", str(2 * batch),
                        "--max_steps", "1", "--entropy_flow_estimate", "full", "--entropy_flow_audit_steps", "1",
                        "--save_strategy", "no"]),
    ]  # fmt: skip


def stage_zero3(check: GpuCheckSettings, recorder: StageRecorder) -> None:
    from opefo_trl.testing import build_tiny_model

    work = os.path.join(check.work_dir, "zero3")
    os.makedirs(work, exist_ok=True)
    shape, vocab = (SHAPES["tiny"], 1024) if check.reduced else (SHAPES["0.5b"], QWEN_VOCAB)
    model = build_tiny_model(os.path.join(work, "model"), vocab_size=vocab, max_position_embeddings=1024, **shape)
    data = os.path.join(work, "problems.jsonl")
    with open(data, "w") as f:
        for i in range(64):
            f.write(json.dumps({"prompt": f"What is {i + 2} + {3 * i + 1}?", "solution": str(4 * i + 3)}) + "\n")
    for old in os.listdir(work):  # earlier runs' checkpoints (GBs): every run starts in a fresh folder
        if old.startswith("runs-"):
            shutil.rmtree(os.path.join(work, old), ignore_errors=True)
    runs_dir = tempfile.mkdtemp(prefix="runs-", dir=work)
    num_generations = 4 if check.reduced else 8
    common = [
        "--config", RECIPE, "--model_name_or_path", model, "--dataset_files", data, "--use_vllm", "false",
        "--num_generations", str(num_generations), "--max_completion_length", "8" if check.reduced else "128",
        "--reward_funcs", "math_accuracy_reward", "benchmarks.precision.even_token_reward",
        "--metrics_jsonl", "main_process", "--logging_steps", "1", "--report_to", "none",
    ]  # fmt: skip
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", ZERO3_CONFIG, "--num_processes", "1"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", DS_BUILD_OPS="0", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    if check.reduced:
        launcher = os.path.join(work, "cpu_launcher.py")
        with open(launcher, "w") as f:
            f.write(CPU_LAUNCHER)
        launch += ["--mixed_precision", "no", launcher]
        common += ["--bf16", "false", "--use_cpu", "true"]
    else:
        launch += ["-m", "opefo_trl.cli.train"]
    recorder.update(command=" ".join(launch + common), runs={})
    for name, output_dir, extra in zero3_plan(check, runs_dir):
        if check.stage_deadline is not None and time.time() > check.stage_deadline:
            recorder.results["runs"][name] = {"skipped": "deadline"}
            recorder.save()
            continue
        metrics_file = os.path.join(output_dir, "metrics.jsonl")
        lines_before = _jsonl(metrics_file)
        timeout = None if check.stage_deadline is None else max(30.0, check.stage_deadline - time.time() + 15)
        print(f"== {name}: {' '.join(extra)}", flush=True)
        start = time.perf_counter()
        process = subprocess.Popen(launch + common + ["--output_dir", output_dir, *extra], cwd=REPO, env=env)
        memory = PeakMemory(process.pid)
        memory.start()
        try:
            exit_code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(process.pid)
            exit_code = "timeout"
        memory.running = False
        memory.join()
        seconds = time.perf_counter() - start
        logged = _jsonl(metrics_file)[len(lines_before) :] if name == "resume" else _jsonl(metrics_file)
        recorder.results["runs"][name] = dict(
            exit_code=exit_code, seconds=round(seconds, 1), peak_memory_bytes=memory.peak, **_run_figures(logged)
        )
        if name in ("resume", "full") and exit_code == 0:
            recorder.results["runs"][name]["files"] = _files(output_dir)
        recorder.save()
    failed = {n: r.get("exit_code") for n, r in recorder.results["runs"].items() if r.get("exit_code") != 0}
    if failed:
        raise RuntimeError(f"launches did not all succeed: {failed}")


def _kill_tree(pid: int) -> None:
    import psutil

    try:
        root = psutil.Process(pid)
        for process in [*root.children(recursive=True), root]:
            process.kill()
    except psutil.Error:
        pass


def _jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _run_figures(logged: list[dict]) -> dict:
    """Per optimizer step: lambda*, measured / predicted entropy change, grad norm, TRL's step time; and the run's
    train_runtime."""
    keys = {
        "lambda": "entropy_flow/lambda", "measured_delta": "entropy_flow/measured_delta",
        "predicted_delta": "entropy_flow/predicted_delta", "grad_norm": "grad_norm", "step_time": "step_time",
        "reward": "reward",
    }  # fmt: skip
    steps = [entry for entry in logged if "entropy_flow/lambda" in entry or "grad_norm" in entry]
    figures = {name: [entry.get(key) for entry in steps] for name, key in keys.items()}
    figures["steps"] = [entry.get("step") for entry in steps]
    summary = [entry for entry in logged if "train_runtime" in entry]
    figures["train_runtime"] = summary[-1]["train_runtime"] if summary else None
    times = [t for t in figures["step_time"] if t is not None]
    figures["median_step_time"] = statistics.median(times) if times else None
    return figures


def _files(output_dir: str) -> dict[str, int]:
    """Relative path -> size of every file under the run's output folder (checkpoints, shards, saved model)."""
    files = {}
    for root, _, names in os.walk(output_dir):
        for name in names:
            full = os.path.join(root, name)
            files[os.path.relpath(full, output_dir)] = os.path.getsize(full)
    return dict(sorted(files.items()))


# ----------------------------------------------------------------------------------------------------------------------
# Stage 3: cost
# ----------------------------------------------------------------------------------------------------------------------

COST_CONFIGS = ["grpo_strict", "opefo", "opefo_full", "opefo_param", "opefo_param_step"]
MEMORY_CONFIGS = ["grpo_strict", "opefo_full", "opefo_param", "opefo_param_lora16"]


def cost_settings(check: GpuCheckSettings):
    """bench_step settings of the cost part (0.5B shape) and the memory part (1.5B shape)."""
    from bench_step import BenchSettings

    if check.reduced:
        batch = dict(vocab_size=1024, completions=4, num_generations=2, completion_length=8, accumulation=[2])
        cost = BenchSettings(
            **SHAPES["tiny"], **batch, steps=1, configs=COST_CONFIGS, gradient_checkpointing=True,
            discard_first_run=False,
        )  # fmt: skip
        memory_shape = dict(SHAPES["tiny"], hidden_size=48, num_layers=3)
    else:
        batch = dict(vocab_size=QWEN_VOCAB, completions=32, num_generations=8, completion_length=256, accumulation=[2])
        cost = BenchSettings(**SHAPES["0.5b"], **batch, steps=2, configs=COST_CONFIGS, gradient_checkpointing=True)
        memory_shape = SHAPES["1.5b"]
    memory = BenchSettings(
        **memory_shape, **batch, steps=1, configs=MEMORY_CONFIGS, gradient_checkpointing=True, discard_first_run=False
    )
    return cost, memory


def stage_cost(check: GpuCheckSettings, recorder: StageRecorder) -> None:
    from bench_step import build_model, compare, prompts_dataset

    dataset = prompts_dataset()
    for part, settings in zip(("cost", "memory"), cost_settings(check), strict=True):
        work = os.path.join(check.work_dir, f"bench-{part}")
        recorder.update(**{f"{part}_settings": asdict(settings)})
        if check.stage_deadline is not None and time.time() > check.stage_deadline:
            recorder.update(**{part: {"skipped": "every configuration"}})
            continue
        model = build_model(settings, work)
        recorder.update(**{part: compare(model, dataset, settings, work, check.stage_deadline,
                                         lambda results, p=part: recorder.update(**{p: results}))})  # fmt: skip


STAGE_FUNCTIONS = {0: stage_environment, 1: stage_precision, 2: stage_zero3, 3: stage_cost}


def _refuse_a_machine_without_gpu(check: GpuCheckSettings) -> None:
    import torch

    stages = [check.run_stage] if check.run_stage is not None else check.stages
    if not check.reduced and set(stages) - {0} and not torch.cuda.is_available():
        raise ValueError(
            f"no CUDA device: stages {sorted(set(stages) - {0})} are for a GPU machine; on a CPU pass --reduced true "
            "(tiny models) or --stages 0."
        )


def run_one_stage(check: GpuCheckSettings) -> int:
    recorder = StageRecorder(check, check.run_stage)
    start = time.time()
    try:
        STAGE_FUNCTIONS[check.run_stage](check, recorder)
        recorder.record["status"] = "ok"
        return 0
    except Exception as err:
        recorder.record.update(status="failed", error=f"{type(err).__name__}: {err}")
        raise
    finally:
        recorder.record["seconds"] = round(time.time() - start, 1)
        recorder.save()


# ----------------------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------------------


def report_markdown(output_dir: str) -> str:
    """The report of every stageN.json in `output_dir` (this run's, and earlier runs' of stages not rerun)."""
    records = {s: read_json(stage_path(output_dir, s)) for s in STAGES}
    records = {s: r for s, r in records.items() if r}
    lines = ["# GPU check", "", "| stage | status | seconds | CPU seconds | timeout s |", "|---|---|---|---|---|"]
    for stage, record in records.items():
        lines.append(
            f"| {stage} {record['name']} | {record.get('status')} | {record.get('seconds', 'n/a')} | "
            f"{record.get('cpu_seconds', 'n/a')} | {record.get('timeout_s', 'n/a')} |"
        )
    sections = {0: _environment_section, 1: _precision_section, 2: _zero3_section, 3: _cost_section}
    for stage, record in records.items():
        lines += ["", f"## Stage {stage}: {record['name']}", ""]
        results = record.get("results") or {}
        if record.get("status") != "ok":
            lines.append(f"Status {record.get('status')}; {record.get('reason', '')} log tail:")
            lines += ["", "```", (record.get("log_tail") or "").strip()[-1500:], "```", ""]
        if results:
            try:
                lines.append(sections[stage](results))
            except (KeyError, TypeError, ValueError) as err:  # a partial result: show what there is
                lines.append(f"(partial results; {type(err).__name__}: {err})")
                lines.append("```json\n" + json.dumps(results, indent=1, default=str)[:3000] + "\n```")
    return "\n".join(lines) + "\n"


def _environment_section(r: dict) -> str:
    lines = [f"Python {r['python']}, {r['platform']}."]
    gpu = r.get("gpu", {})
    if gpu.get("cuda_available"):
        lines.append(
            f"GPU {gpu['name']} (compute {gpu['capability']}, {gpu['memory_gib']} GiB, driver {gpu['driver']}), "
            f"CUDA {gpu['torch_cuda']}, bf16 supported {gpu['bf16_supported']}."
        )
    else:
        lines.append("No CUDA device.")
    lines.append(f"Matmul precision settings: {r.get('precision_settings')}.")
    lines.append(f"TRL kernels: {r.get('trl_kernels')}; fused-head smoke test: {r.get('fused_head_smoke')}.")
    lines.append(f"DeepSpeed: {r.get('deepspeed')}.")
    lines += ["", "| package | version | from |", "|---|---|---|"]
    for name, info in r.get("packages", {}).items():
        lines.append(f"| {name} | {info.get('version', info.get('error'))} | {info.get('path', '')} |")
    return "\n".join(lines)


def _precision_section(r: dict) -> str:
    import precision

    return precision.markdown(r)


def _zero3_section(r: dict) -> str:
    lines = [
        f"`{r['command']}`",
        "",
        "| run | exit | steps | s/step (TRL step_time, median) | train_runtime s | wall s | peak memory GiB | "
        "lambda* per step | measured change per step | grad norm per step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, run in r.get("runs", {}).items():
        if "exit_code" not in run:
            lines.append(f"| {name} | {run} | | | | | | | | |")
            continue
        lines.append(
            f"| {name} | {run['exit_code']} | {run['steps']} | {_num(run['median_step_time'], '.2f')} | "
            f"{_num(run['train_runtime'], '.1f')} | {run['seconds']} | {run['peak_memory_bytes'] / 2**30:.2f} | "
            f"{_list(run['lambda'])} | {_list(run['measured_delta'])} | {_list(run['grad_norm'])} |"
        )
    for name in ("resume", "full"):
        files = r.get("runs", {}).get(name, {}).get("files")
        if files:
            lines += ["", f"Files of the `{name}` run's output folder, by folder (sizes from 0.1 MiB):", ""]
            by_folder = {}
            for path, size in files.items():
                folder, base = os.path.split(path)
                shown = f"{base} {size / 2**20:.1f} MiB" if size >= 2**20 / 10 else base
                by_folder.setdefault(folder or ".", []).append(shown)
            lines += [f"- `{folder}/`: {', '.join(names)}" for folder, names in by_folder.items()]
    return "\n".join(lines)


def _cost_section(r: dict) -> str:
    from bench_step import markdown_table

    lines = []
    for part, title in (("cost", "Step time and memory"), ("memory", "Peak memory of the larger shape")):
        settings = r.get(f"{part}_settings", {})
        lines += [
            f"### {title} (hidden {settings.get('hidden_size')}, {settings.get('num_layers')} layers, "
            f"{settings.get('completions')} x {settings.get('completion_length')} tokens, accumulation "
            f"{settings.get('accumulation')}, gradient checkpointing {settings.get('gradient_checkpointing')})",
            "",
        ]
        for key, medians in (r.get(part) or {}).items():
            if key == "skipped":
                lines += [f"Not run (deadline): {medians}", ""]
                continue
            lines.append(markdown_table(medians))
            if part == "memory":
                lines += ["", "| configuration | peak GiB (absolute) |", "|---|---|"]
                lines += [f"| {n} | {m['peak_total_bytes'] / 2**30:.2f} |" for n, m in medians.items()]
        lines.append("")
    return "\n".join(lines)


def _num(x, spec):
    return "n/a" if x is None else format(x, spec)


def _list(values) -> str:
    return ", ".join("n/a" if v is None else f"{v:+.3g}" for v in values) if values else "n/a"


# ----------------------------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    from opefo_trl.cli.options import INPUT_ERRORS, build_parser, parse_options, report_error

    parser = build_parser([GpuCheckSettings], prog="gpu_check.py", description=__doc__)
    try:
        (check,) = parse_options(parser, argv)
        _refuse_a_machine_without_gpu(check)
    except INPUT_ERRORS as err:
        return report_error(parser.prog, err)
    if check.run_stage is not None:
        return run_one_stage(check)
    outcomes = run_stages(check)
    text = report_markdown(check.output_dir)
    if check.report:
        with open(check.report, "w") as f:
            f.write(text)
    print(text)
    return 0 if all(o["status"] == "ok" for o in outcomes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
