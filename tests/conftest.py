"""Shared offline fixtures: a tiny local Qwen2-shaped model + ChatML tokenizer, small arithmetic data sets and files."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import pytest

# The example method registers itself when imported: only its test imports it (and unregisters it afterwards).
collect_ignore = ["methods/example_method.py"]


@pytest.fixture(scope="session")
def keep_dtype_rms_norm():
    """``keep_dtype_rms_norm(model) -> model``: a Qwen2 in float64 stays float64 through its RMSNorms."""
    from opefo_trl.testing import keep_rms_norm_in_model_dtype

    return keep_rms_norm_in_model_dtype


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """Path of a saved random tiny Qwen2 model (hidden 64, 2 layers) with its tokenizer."""
    from opefo_trl.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2") / "model")


@pytest.fixture(scope="session")
def tiny_dataset():
    """16 conversational arithmetic prompts with their answers (TRL's `prompt` + a `solution` column)."""
    from datasets import Dataset

    rows = []
    for i in range(16):
        a, b = i + 2, 3 * i + 1
        rows.append({"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "solution": str(a + b)})
    return Dataset.from_list(rows)


def length_reward(completions, **kwargs):
    """Deterministic and varied within a group, so advantages are non-zero (a reward for training tests)."""
    return [float(len(c[0]["content"]) % 3) for c in completions]


@pytest.fixture(name="length_reward")
def length_reward_fixture():
    return length_reward


def _write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


@pytest.fixture(scope="session")
def write_jsonl():
    """``write_jsonl(path, rows) -> str``: write dicts as JSON lines, return the path."""
    return _write_jsonl


@pytest.fixture(scope="session")
def problems_file(tmp_path_factory):
    """Training data in open-r1/DAPO-Math-17k-Processed's columns: 16 `prompt` problems with their `solution`."""
    rows = [{"prompt": f"What is {i + 2} + {3 * i + 1}?", "solution": str(4 * i + 3)} for i in range(16)]
    return _write_jsonl(tmp_path_factory.mktemp("data") / "problems.jsonl", rows)


@pytest.fixture(scope="session")
def bench_file(tmp_path_factory):
    """A local benchmark `arith.jsonl` in opefo-eval's default columns: 4 problems, i + (i + 1) with gold 2i + 1."""
    rows = [{"problem": f"What is {i} + {i + 1}?", "answer": str(2 * i + 1)} for i in range(4)]
    return _write_jsonl(tmp_path_factory.mktemp("bench") / "arith.jsonl", rows)


@pytest.fixture(scope="session")
def warm_model_path(tiny_model_path, tmp_path_factory):
    """The tiny model after a few supervised steps on fixed answers: peaked policies, away from the entropy maximum
    (near it, a step's first-order entropy change is swamped by curvature)."""
    from opefo_trl.testing import warm_up_tiny_model

    return warm_up_tiny_model(tiny_model_path, tmp_path_factory.mktemp("warm") / "model")


def _snapshot(folder) -> dict[str, str]:
    """``{relative path: sha256 of the content}`` of every file under ``folder`` (empty folders as ``path/``)."""
    import hashlib

    files = {}
    for root, dirs, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
        for name in dirs:
            if not os.listdir(os.path.join(root, name)):
                files[os.path.relpath(os.path.join(root, name), folder) + "/"] = ""
    return files


@pytest.fixture(scope="session")
def snapshot():
    """``snapshot(folder)``: file list and contents, to assert that a refused command wrote and deleted nothing."""
    return _snapshot


def _write_checkpoint(folder, step: int, method: str = "opefo", complete: bool = True):
    """``folder/checkpoint-<step>`` with the kinds of files Trainer writes there (safetensors weights, torch.save
    archives, JSON states, OPEFO's method state), small and whole, and its completion marker (``complete``), named in
    the manifest of ``folder`` as a run of opefo-train does; returns its path."""
    import torch
    from safetensors.torch import save_file

    from opefo_trl.runs import METHOD_STATE_NAME, mark_checkpoint_complete, record_in_manifest

    path = folder / f"checkpoint-{step}"
    path.mkdir(parents=True)
    save_file({"a": torch.arange(3000.0), "b": torch.ones(5, 7)}, str(path / "model.safetensors"))
    torch.save({"state": {0: torch.zeros(10)}}, path / "optimizer.pt")
    torch.save({"python": 1}, path / "rng_state.pth")
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
    (path / METHOD_STATE_NAME).write_text(json.dumps({"method": method, "state": {}}))
    (path / "tokenizer.json").write_text("{}")
    if complete:
        mark_checkpoint_complete(str(path))
    record_in_manifest(str(folder), [path.name])
    return path


@pytest.fixture(scope="session")
def write_checkpoint():
    """``write_checkpoint(folder, step, method="opefo", complete=True) -> path``: a small checkpoint of a run of ours
    (see _write_checkpoint)."""
    return _write_checkpoint


@pytest.fixture
def saved_run(tmp_path, write_checkpoint):
    """A run folder of ours (`opefo_trl.runs`) with checkpoints 2 and 4, metrics, a final model (all in its
    manifest), an opefo-eval folder of its own and a hidden file."""
    import torch
    from safetensors.torch import save_file

    from opefo_trl.runs import record_in_manifest

    folder = tmp_path / "run"
    for step in (2, 4):
        write_checkpoint(folder, step)
    (folder / "metrics.jsonl").write_text('{"step": 1}\n')
    (folder / "metrics.rank1.jsonl").write_text('{"step": 1}\n')
    save_file({"a": torch.zeros(2)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text("{}")
    record_in_manifest(str(folder), ["metrics.jsonl", "metrics.rank1.jsonl", "model.safetensors", "config.json"])
    (folder / "eval").mkdir()
    (folder / "eval" / "samples.jsonl").write_text("{}\n")
    (folder / ".keep").write_text("hidden")
    return folder


# The demo's smallest budget that still runs every stage of the real code path and learns something: a tiny model
# warm-started until it writes digits (so rewards, advantages and flows are not all zero), 2 RL steps per run at the
# full learning rate (`--quick true` halves the warm start and keeps at least 2 RL steps), 4 held-out samples.
DEMO_TINY = dict(
    hidden_size=32,
    num_layers=1,
    warm_start_steps=120,
    warm_start_batch_size=16,
    warmup_steps=0,
    steps=2,
    prompts_per_step=2,
    num_generations=4,
    pass_at_k_samples=4,
    pass_at_k=[1, 4],
)


@pytest.fixture
def tiny_flags() -> list[str]:
    """DEMO_TINY as `python -m opefo_trl.demo` flags."""
    flags = []
    for name, value in DEMO_TINY.items():
        flags += [f"--{name}", *map(str, value if isinstance(value, list) else [value])]
    return flags


@pytest.fixture
def tiny_settings():
    """The demo's ``DemoSettings`` at the DEMO_TINY budget, with overrides."""
    from opefo_trl.demo import DemoSettings

    return lambda **overrides: DemoSettings(**{**DEMO_TINY, **overrides})


# ----------------------------------------------------------------------------------------------------------------------
# Run folders as a Trainer leaves them (plotting, opefo-plot)
# ----------------------------------------------------------------------------------------------------------------------

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_trainer_state(folder, rows):
    """A run folder holding a trainer_state.json with ``rows`` as its log_history; returns the file's path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "trainer_state.json"
    path.write_text(json.dumps({"global_step": len(rows), "log_history": rows}))
    return path


def trainer_state_rows(n, entropy0, flows=True):
    """``n`` logged steps of entropy, reward and (with ``flows``) the entropy flows, then the Trainer's closing row."""
    rows = []
    for step in range(1, n + 1):
        row = {"step": step, "epoch": step / n, "entropy": entropy0 / step, "reward": 0.1 * step, "loss": 0.0}
        if flows:
            row.update(
                {
                    "entropy_flow/lambda": 0.01 * (-1) ** step,
                    "entropy_flow/increase": 1.0 + step,
                    "entropy_flow/decrease": 2.0 + step,
                }
            )
        rows.append(row)
    # the Trainer's closing row has a step but no training metrics
    rows.append({"step": n, "train_runtime": 1.5, "train_loss": 0.0, "total_flos": 0.0})
    return rows


def png_size(path):
    """(width, height) of a PNG file, refusing anything else."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, "not a PNG file"
    width = int.from_bytes(data[16:20], "big")
    height = int.from_bytes(data[20:24], "big")
    return width, height


# opefo_trl.eval tests: an option factory, a reader of samples.jsonl, and a guard on model loading.


def _config(model, bench, out, **overrides):
    from opefo_trl.eval import EvaluationConfig

    settings = dict(
        model_name_or_path=model,
        benchmarks=[bench],
        num_samples=3,
        max_new_tokens=6,
        batch_size=4,
        output_dir=str(out),
        backend="transformers",
        dtype="float32",
        progress=False,
    )
    settings.update(overrides)
    return EvaluationConfig(**settings)


def _read_samples(out):
    with open(os.path.join(out, "samples.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return {(r["benchmark"], r["problem_id"], r["sample_index"]): r["completion"] for r in records}, records


@pytest.fixture(scope="session")
def eval_config():
    """``eval_config(model, bench, out, **overrides)``: a small CPU EvaluationConfig (3 samples of 6 tokens, fp32)."""
    return _config


@pytest.fixture(scope="session")
def read_samples():
    """``read_samples(out) -> ({(benchmark, problem, sample): completion}, records)`` from ``out/samples.jsonl``."""
    return _read_samples


@pytest.fixture
def no_model_loading(monkeypatch):
    """Fail the test if the model would be loaded."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    from opefo_trl.eval import TransformersBackend

    monkeypatch.setattr(TransformersBackend, "load", refuse)


@pytest.fixture(scope="session")
def vllm_model_path(tmp_path_factory):
    """A tiny Qwen2 vLLM's CPU attention accepts (head size 32; it refuses the 16 of ``tiny_model_path``)."""
    from opefo_trl.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-vllm") / "model", hidden_size=128, num_heads=4)


@pytest.fixture(scope="session")
def vllm_cpu_gemm():
    """vLLM's CPU build computing with each layer's own weight, so that TRL's colocate weight sync works (the tier's
    one workaround; why in ``tests/vllm_cpu_gemm.py``); the script's path, for subprocesses."""
    pytest.importorskip("vllm")
    import vllm_cpu_gemm as patch

    patch.install()
    return patch.__file__


@pytest.fixture
def read_only_dir(tmp_path):
    """An empty folder nothing can be written into, for this user too: a read-only tmpfs where mounting works (root,
    whom permission bits do not stop), else a folder without write permission."""
    import subprocess

    folder = tmp_path / "read-only"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a read-only tmpfs here: {mounted.stderr.decode().strip()}")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], check=True)


@pytest.fixture
def small_disk(tmp_path):
    """``small_disk(free_pages) -> folder``: a real tmpfs filled up to ``free_pages`` free 4 KiB pages (a full disk
    where a write fails with ENOSPC). Mounting needs root; skipped elsewhere."""
    import subprocess

    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")

    def fill(free_pages: int):
        stat = os.statvfs(disk)
        with open(disk / "filler", "wb") as f:
            f.write(b"\0" * (stat.f_bavail * stat.f_frsize - free_pages * 4096))
        assert os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize == free_pages * 4096
        return disk

    yield fill
    subprocess.run(["umount", "-l", str(disk)], check=True)


# --- The real-model tier: SmolLM2-135M-Instruct (``opefo_trl.real_model``), run by `make test-real` (-m real_model).
# The suite's addopts deselect the tier; a `-m` expression that replaces them without selecting ``real_model`` (as
# `make test-fast` and `make test-kernels` give) would run it: its tests are then skipped with the reason, so those
# stay as fast as without the tier. Asked for, a missing wheel or gguf is the error that names what installs it.


def pytest_collection_modifyitems(config, items):
    expression = config.getoption("markexpr") or ""
    if "real_model" in expression and "not real_model" not in expression:
        return
    skip = pytest.mark.skip(reason="the real-model tier: `make test-real` installs what it needs and runs it")
    for item in items:
        if item.get_closest_marker("real_model") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def real_model_path() -> str:
    """The plain SmolLM2-135M-Instruct folder (built on first use into the user's cache, ~45 s; then reused)."""
    from opefo_trl.real_model import smollm2_135m_instruct

    return os.fspath(smollm2_135m_instruct())


@pytest.fixture(scope="session")
def arithmetic_prompts():
    """Four one-digit sums in the answer form the 4-bit model sometimes follows, with their answers."""
    from datasets import Dataset

    sums = [(2, 3), (4, 4), (6, 1), (3, 5)]
    return Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": f"What is {a} + {b}? Reply with: The answer is N."}],
                "solution": str(a + b),
            }
            for a, b in sums
        ]
    )


def flat_recipe_text(path) -> str:
    """A recipe merged with its bases (`opefo_trl.cli.recipe_files`) as the text of one YAML file without `base`, for
    tests that write an edited copy elsewhere (a copy of the file itself would look for its base beside the copy)."""
    import yaml

    from opefo_trl.cli.recipe_files import load_recipe

    return yaml.safe_dump(load_recipe(path), sort_keys=False, default_flow_style=None, width=1000)


def load_benchmark(name: str):
    """The script ``benchmarks/<name>.py`` as a module (the benchmarks are scripts, not a package)."""
    import importlib.util
    import sys

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
