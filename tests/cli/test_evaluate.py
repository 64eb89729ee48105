"""`opefo-eval` through `main(argv)`: a run on the tiny model, the same run from a YAML recipe, bad input."""

import json
import os

import pytest

from opefo_trl.cli.evaluate import main


def test_cli_runs_and_reports_bad_input(tiny_model_path, bench_file, tmp_path, capsys):
    args = [
        "--model_name_or_path",
        tiny_model_path,
        "--benchmarks",
        bench_file,
        "--num_samples",
        "2",
        "--max_new_tokens",
        "3",
        "--max_problems",
        "2",
        "--backend",
        "transformers",
        "--no_progress",
        "--output_dir",
        str(tmp_path),
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "| arith | 2 | 2 |" in out and (tmp_path / "results.md").exists()

    assert main(args[:3] + ["aime2024"] + args[4:]) == 2
    assert "opefo-eval: error: Unknown benchmark 'aime2024'" in capsys.readouterr().err
    assert main(args + ["--pass_at_k", "4"]) == 2
    assert "opefo-eval: error: pass@4 was requested" in capsys.readouterr().err
    assert main(args + ["--top_p", "0"]) == 2
    assert "opefo-eval: error: top_p must be in (0, 1]" in capsys.readouterr().err

    # The same options from a YAML recipe: same settings, so the finished run is reused, not resampled.
    recipe = tmp_path / "eval.yaml"
    recipe.write_text(
        f"model_name_or_path: {tiny_model_path}\nbenchmarks: [{bench_file}]\nnum_samples: 2\nmax_new_tokens: 3\n"
        f"max_problems: 2\nbackend: transformers\nprogress: false\noutput_dir: {tmp_path}\n"
    )
    written = (tmp_path / "samples.jsonl").read_text()
    assert main(["--config", str(recipe)]) == 0
    assert "| arith | 2 | 2 |" in capsys.readouterr().out
    assert (tmp_path / "samples.jsonl").read_text() == written
    # Kebab-case spellings are transformers' aliases of the same options.
    assert main(["--config", str(recipe), "--max-problems", "2"]) == 0
    assert (tmp_path / "samples.jsonl").read_text() == written


def test_cli_refuses_an_empty_benchmark_file_and_an_output_dir_that_is_a_file(tiny_model_path, tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "out.txt").write_text("a file")
    args = ["--model_name_or_path", tiny_model_path, "--backend", "transformers", "--no_progress"]
    assert main(args + ["--benchmarks", str(tmp_path / "empty.jsonl"), "--output_dir", str(tmp_path / "o")]) == 2
    assert f"opefo-eval: error: Data file '{tmp_path / 'empty.jsonl'}' is empty" in capsys.readouterr().err
    assert main(args + ["--benchmarks", "aime24", "--output_dir", str(tmp_path / "out.txt")]) == 2
    assert f"output_dir '{tmp_path / 'out.txt'}' is a file; give a directory" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["empty.jsonl", "out.txt"]


def test_cli_names_a_model_folder_without_tokenizer_files(tiny_model_path, bench_file, tmp_path, capsys):
    """Issue 32, D8: an IndexError after the model loaded."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_path, model, ignore=shutil.ignore_patterns("tokenizer*", "vocab*", "merges*"))
    argv = ["--model_name_or_path", str(model), "--benchmarks", bench_file, "--output_dir", str(tmp_path / "eval")]
    assert main([*argv, "--backend", "transformers", "--no_progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"opefo-eval: error: Model directory {model} has no tokenizer files")
    assert "Traceback" not in err
    assert not (tmp_path / "eval").exists()


def test_cli_names_a_model_folder_without_weights(tiny_model_path, bench_file, tmp_path, capsys):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_path, model)
    os.remove(model / "model.safetensors")
    argv = ["--model_name_or_path", str(model), "--benchmarks", bench_file, "--output_dir", str(tmp_path / "eval")]
    assert main([*argv, "--backend", "transformers", "--no_progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"opefo-eval: error: {model} holds no weights (no *.safetensors") and "Traceback" not in err


@pytest.mark.parametrize("left", ["staged", "unfinished"])
def test_a_run_folder_whose_final_model_is_not_in_place_says_where_it_is(
    left, tiny_model_path, bench_file, tmp_path, capsys
):
    """A run folder whose final model was still staged (or kept unfinished after a kill) was said only to hold
    "neither a model ... nor a PEFT adapter"."""
    import shutil

    from opefo_trl.runs import FINAL_MODEL_STAGING, UNFINISHED_FINAL_MODEL

    run = tmp_path / "run"
    (run / "checkpoint-2").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    model = run / (FINAL_MODEL_STAGING if left == "staged" else UNFINISHED_FINAL_MODEL)
    shutil.copytree(tiny_model_path, model)
    argv = ["--model_name_or_path", str(run), "--benchmarks", bench_file, "--output_dir", str(tmp_path / "eval")]
    assert main([*argv, "--backend", "transformers", "--no_progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"opefo-eval: error: {run} holds neither a model (config.json) nor a PEFT adapter ")
    if left == "staged":
        assert f"the final model of its run is still staged in {model} (that run is saving it, or was stopped" in err
        assert "run its opefo-train command again, which moves the model into place" in err
    else:
        assert f"its run was killed while saving its final model, which is kept in {model} and may lack" in err
        assert f"(--model_name_or_path {model})" in err
    assert f"or evaluate one of its checkpoints (--model_name_or_path {run / 'checkpoint-2'})." in err


@pytest.mark.parametrize("cut_to", [100, 4000, "half"])
def test_cut_off_weights_are_one_line_naming_the_file_and_the_fix(
    cut_to, tiny_model_path, bench_file, tmp_path, capsys
):
    """A model.safetensors cut short (what an interrupted copy leaves) gave safetensors' own SafetensorError."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_path, model)
    weights = model / "model.safetensors"
    size = weights.stat().st_size // 2 if cut_to == "half" else cut_to
    os.truncate(weights, size)
    argv = ["--model_name_or_path", str(model), "--benchmarks", bench_file, "--output_dir", str(tmp_path / "eval")]
    assert main([*argv, "--backend", "transformers", "--no_progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"opefo-eval: error: {weights} ({size} bytes) cannot be read by safetensors (cut short or ")
    assert "Copy that file again from where it came from" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "eval").exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--temperature", "nan"], "temperature=nan: options must be finite numbers."),
        (["--temperature", "inf"], "temperature=inf: options must be finite numbers."),
        (["--top_p", "nan"], "top_p=nan: options must be finite numbers."),
        (["--vllm_gpu_memory_utilization", "inf"], "vllm_gpu_memory_utilization=inf: options must be finite"),
        (["--vllm_gpu_memory_utilization", "1.5"], "vllm_gpu_memory_utilization must be in (0, 1]"),
        (["--vllm_tensor_parallel_size", "0"], "vllm_tensor_parallel_size must be at least 1, got 0."),
        (["--max_model_len", "0"], "max_model_len must be at least 1, got 0."),
    ],
)
def test_cli_refuses_non_finite_and_out_of_range_numbers_before_loading(
    flags, message, tiny_model_path, bench_file, tmp_path, capsys, no_model_loading
):
    """A temperature of nan or inf would sample garbage that is then scored as if it were the model's answers."""
    out = tmp_path / "eval"
    argv = ["--model_name_or_path", tiny_model_path, "--benchmarks", bench_file, "--output_dir", str(out)]
    assert main([*argv, "--backend", "transformers", "--no_progress", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"opefo-eval: error: {message}") and "Traceback" not in err
    assert not out.exists()


def _small_run(model, bench_file, out) -> list[str]:
    return [
        "--model_name_or_path",
        str(model),
        "--benchmarks",
        bench_file,
        "--num_samples",
        "2",
        "--max_new_tokens",
        "3",
        "--max_problems",
        "2",
        "--backend",
        "transformers",
        "--no_progress",
        "--output_dir",
        str(out),
    ]


def test_cli_refuses_samples_it_cannot_tie_to_the_model(tiny_model_path, bench_file, tmp_path, capsys):
    """Samples are reused only with the record of what drew them, whole, and only for the very same weights: a store
    whose run_config.json is missing (e.g. another model's samples.jsonl copied in) or cut off is refused, and so is
    a store after an in-place edit of one weight no sample of the file would have read."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_path, model)
    out = tmp_path / "eval"
    argv = _small_run(model, bench_file, out)
    assert main(argv) == 0
    samples = (out / "samples.jsonl").read_text()
    settings = (out / "run_config.json").read_text()
    capsys.readouterr()

    (out / "run_config.json").unlink()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"opefo-eval: error: {out / 'samples.jsonl'} holds 4 samples, but {out / 'run_config.json'} (the model, "
        "weights and settings they were drawn with) is missing"
    )
    assert "Traceback" not in err and (out / "samples.jsonl").read_text() == samples

    (out / "run_config.json").write_text(settings[: len(settings) // 2])  # cut off
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"opefo-eval: error: {out / 'run_config.json'} is not valid JSON (")
    assert "Restore it, use another output_dir, or overwrite=True (--overwrite true)" in err

    (out / "run_config.json").write_text(settings)
    assert main(argv) == 0  # whole again: reused
    assert (out / "samples.jsonl").read_text() == samples
    weights = model / "model.safetensors"
    stat = weights.stat()
    with open(weights, "r+b") as f:  # in place, one byte of row 1 of the largest matrix (not its first, middle or last)
        header_length = int.from_bytes(f.read(8), "little")
        header = {k: v for k, v in json.loads(f.read(header_length)).items() if k != "__metadata__"}
        name = max(header, key=lambda k: header[k]["shape"][0] if header[k]["shape"] else 0)
        start, end = header[name]["data_offsets"]
        offset = 8 + header_length + start + (end - start) // header[name]["shape"][0]
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 1]))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"opefo-eval: error: {out} holds 4 samples drawn from other weights: model/model.safetensors")


@pytest.mark.slow
def test_a_second_run_into_a_store_in_use_is_refused_at_once(tiny_model_path, bench_file, tmp_path, capsys):
    """Two opefo-eval runs into one output_dir would interleave their draws in one samples.jsonl (at two temperatures,
    under one run_config.json); a run is refused at once while another process holds the store's lock (held here by
    a process that only holds it, so that the test does not depend on how long a real run takes), and fills the
    store once the lock is free."""
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "eval"
    argv = _small_run(tiny_model_path, bench_file, out)
    environment = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from opefo_trl.runs.folder import RunLock; RunLock(sys.argv[1]).acquire(); "
            "print('held', flush=True); time.sleep(600)",
            str(out),
        ],
        env=environment,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert main([*argv, "--temperature", "0.5"]) == 2
        err = capsys.readouterr().err
        # the data set's loading progress may precede the one error line on stderr
        assert f"opefo-eval: error: output_dir '{out}' is in use by another run: pid {holder.pid} on " in err
        assert "would mix their samples (both runs' draws in one samples.jsonl" in err and "Traceback" not in err
        assert not (out / "samples.jsonl").exists() and not (out / "run_config.json").exists()
    finally:
        holder.kill()
        holder.wait()
    assert main(argv) == 0
    assert (out / "samples.jsonl").read_text().strip()
    assert json.loads((out / "run_config.json").read_text())["temperature"] == 1.0
    assert not (out / ".opefo_run.lock").exists()


def test_an_output_dir_that_cannot_be_written_is_one_line_before_loading(
    tiny_model_path, bench_file, read_only_dir, capsys, no_model_loading, monkeypatch
):
    """Refused before the benchmarks load (a hub download) and before the model does, not by a traceback after."""
    import opefo_trl.eval.runner

    def refuse(*args, **kwargs):
        raise AssertionError("the benchmarks were loaded")

    monkeypatch.setattr(opefo_trl.eval.runner, "load_problems", refuse)
    for out in (read_only_dir, read_only_dir / "eval"):
        assert main(_small_run(tiny_model_path, bench_file, out)) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"opefo-eval: error: Cannot write into output_dir '{out}' (") and "Traceback" not in err
        assert "give a folder this user can write to." in err


@pytest.mark.parametrize(
    "device, message",
    [
        ("tpu9", "device='tpu9' is not a torch device (Invalid device string: 'tpu9'); give cpu, cuda"),
        ("cuda", "device='cuda' but this machine has no CUDA GPU that torch can use"),
        ("cuda:0", "device='cuda:0' but this machine has no CUDA GPU that torch can use"),
    ],
)
def test_a_device_this_machine_does_not_have_is_one_line_before_loading(
    device, message, tiny_model_path, bench_file, tmp_path, capsys, monkeypatch, no_model_loading
):
    """O: `--device cuda` on a machine without CUDA, and `--device tpu9`, were tracebacks."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU machine, also where a GPU is
    out = tmp_path / "eval"
    argv = ["--model_name_or_path", tiny_model_path, "--benchmarks", bench_file, "--output_dir", str(out)]
    assert main([*argv, "--backend", "transformers", "--no_progress", "--device", device]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"opefo-eval: error: {message}") and "Traceback" not in err
    assert not out.exists()


def test_a_model_whose_weights_hold_nan_is_refused_before_loading(
    tiny_model_path, bench_file, tmp_path, capsys, no_model_loading
):
    """G: its empty completions were scored 0.0, exit 0, as if it had answered wrongly."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    model = tmp_path / "diverged"
    shutil.copytree(tiny_model_path, model)
    weights = load_file(str(model / "model.safetensors"))
    weights["model.norm.weight"][0] = float("inf")
    weights["model.layers.0.mlp.up_proj.weight"][1, 2] = float("nan")
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    assert torch.isfinite(weights["model.embed_tokens.weight"]).all()
    out = tmp_path / "eval"
    argv = ["--model_name_or_path", str(model), "--benchmarks", bench_file, "--output_dir", str(out)]
    assert main([*argv, "--backend", "transformers", "--no_progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"opefo-eval: error: The weights of {model} hold NaN or inf (2 tensor(s): "
        "model/model.safetensors:model.layers.0.mlp.up_proj.weight, model/model.safetensors:model.norm.weight)"
    )
    assert "Traceback" not in err and not out.exists()


def test_the_math_reward_mode_is_a_flag_and_a_mode_it_lacks_is_one_line(tmp_path, capsys):
    from opefo_trl.cli.evaluate import make_parser
    from opefo_trl.cli.options import parse_options

    (config,) = parse_options(make_parser(), ["--model_name_or_path", "m", "--math_reward_mode", "strict"])
    assert config.math_reward_mode == "strict"
    recipe = tmp_path / "eval.yaml"
    recipe.write_text("model_name_or_path: m\nmath_reward_mode: exact\n")
    assert main(["--config", str(recipe)]) == 2
    assert "opefo-eval: error: math_reward_mode='exact' is not a mode of the math reward" in capsys.readouterr().err


def test_a_run_folder_is_evaluated_with_the_prompt_and_reward_mode_it_was_trained_with(
    tiny_model_path, bench_file, tmp_path, capsys
):
    """Issue 53: opefo-eval scored a run with its own defaults, whatever the run had trained with. It takes the prompt
    template and reward mode from the run's record (opefo_run_options.json, which opefo-train writes beside the
    final model), says so, and the command line overrides them; a folder without a record keeps the defaults."""
    import shutil

    from opefo_trl.runs import RUN_OPTIONS_NAME

    run = tmp_path / "run"
    shutil.copytree(tiny_model_path, run)
    (run / RUN_OPTIONS_NAME).write_text(json.dumps({"prompt_template": "worked_example", "math_reward_mode": "strict"}))
    common = ["--benchmarks", bench_file, "--num_samples", "1", "--max_new_tokens", "2", "--max_problems", "1"]
    common += ["--backend", "transformers", "--no_progress"]

    def evaluate(model, out, *extra):
        capsys.readouterr()
        assert main(["--model_name_or_path", str(model), *common, "--output_dir", str(tmp_path / out), *extra]) == 0
        config = json.loads((tmp_path / out / "results.json").read_text())["config"]
        said = capsys.readouterr().out.splitlines()[0]  # the first line of its output
        assert config["prompt_and_reward_source"] == said
        return (config["prompt_template"], config["math_reward_mode"]), said

    record = run / RUN_OPTIONS_NAME
    assert evaluate(run, "from-run") == (
        ("worked_example", "strict"),
        f"Evaluating with prompt_template='worked_example' and math_reward_mode='strict' (the run's, from {record}). "
        "Give --prompt_template / --math_reward_mode to choose others.",
    )
    assert evaluate(run, "overridden", "--math_reward_mode", "equivalent") == (
        ("worked_example", "equivalent"),
        f"Evaluating with prompt_template='worked_example' (the run's, from {record}) and "
        "math_reward_mode='equivalent' (given). Give --prompt_template / --math_reward_mode to choose others.",
    )
    assert evaluate(tiny_model_path, "no-record") == (
        ("qwen_math_boxed", "equivalent"),
        f"Evaluating with prompt_template='qwen_math_boxed' and math_reward_mode='equivalent' (default; "
        f"{tiny_model_path} holds no {RUN_OPTIONS_NAME}).",
    )
    record.write_text("[]")
    capsys.readouterr()
    assert main(["--model_name_or_path", str(run), *common, "--output_dir", str(tmp_path / "bad")]) == 2
    assert capsys.readouterr().err == (
        f"opefo-eval: error: {record} holds list, not the mapping of options a run writes.\n"
    )


def test_a_benchmark_that_cannot_be_downloaded_is_one_line(tiny_model_path, tmp_path, monkeypatch, capsys):
    """Issue 53: the README's first opefo-eval command, offline, ended in a 39-line RuntimeError traceback."""
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'HuggingFaceH4/aime_2024' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    assert main(["--model_name_or_path", tiny_model_path, "--output_dir", str(tmp_path / "eval")]) == 2
    assert capsys.readouterr().err == (
        "opefo-eval: error: Could not load benchmark 'aime24' from HuggingFaceH4/aime_2024 (split 'train'): "
        "ConnectionError: Couldn't reach 'HuggingFaceH4/aime_2024' on the Hub (OfflineModeIsEnabled). Offline, "
        "download it beforehand or pass a local copy with benchmark_files=aime24=PATH.\n"
    )


def test_an_adapter_whose_base_model_cannot_be_found_is_one_line(tiny_model_path, bench_file, tmp_path, capsys):
    """Issue 53: transformers' OSError for a base model neither on the hub nor in the cache was a traceback."""
    import shutil

    adapter = tmp_path / "adapter"
    shutil.copytree(tiny_model_path, adapter, ignore=shutil.ignore_patterns("config.json", "model.safetensors"))
    shutil.copy(os.path.join(tiny_model_path, "model.safetensors"), adapter / "adapter_model.safetensors")
    (adapter / "adapter_config.json").write_text('{"base_model_name_or_path": "nobody/no-such-model"}')
    argv = ["--model_name_or_path", str(adapter), "--benchmarks", bench_file, "--backend", "transformers"]
    assert main([*argv, "--no_progress", "--output_dir", str(tmp_path / "eval")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.endswith("\n") and err.count("opefo-eval: error:") == 1
    assert err.splitlines()[-1].startswith("opefo-eval: error: Cannot load the model 'nobody/no-such-model': ")


@pytest.mark.parametrize(
    "free_pages, stored",
    [(0, 0), (1, 0), (3, None)],
    ids=["at-the-lock", "at-run_config.json", "while-sampling"],
)
def test_a_full_disk_is_one_line_saying_what_was_kept_and_leaves_no_partial_file(
    free_pages, stored, small_disk, tiny_model_path, bench_file, capsys
):
    """T: an OSError traceback, and a 0-byte .run_config.json.tmp left behind. Now, on a real full tmpfs: exit 2, one
    line naming the full disk and the samples kept, nothing half-written (no temporary file, no lock file, no cut-off
    samples line); once space is freed the same command finishes, sampling only what is missing."""
    out = small_disk(free_pages) / "eval"
    argv = [
        "--model_name_or_path", tiny_model_path, "--benchmarks", bench_file, "--output_dir", str(out),
        "--backend", "transformers", "--no_progress", "--num_samples", "8", "--max_new_tokens", "24",
        "--batch_size", "4",
    ]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].startswith("opefo-eval: error: Cannot write ") and "its disk is full (No space left" in errors[0]
    samples = out / "samples.jsonl"
    lines = samples.read_text().splitlines(keepends=True) if samples.exists() else []
    assert all(line.endswith("\n") and json.loads(line) for line in lines)  # whole samples only
    if stored is None:  # while sampling: some were kept
        stored = len(lines)
        assert 0 < stored < 32
    assert len(lines) == stored
    kept = f"the {stored} samples stored in {samples}" if stored else f"no samples yet (none in {samples})"
    assert f"Kept: {kept}; no file of {out} is left half-written. Free space on that disk" in errors[0]
    assert not [name for name in os.listdir(out) if name.startswith(".")]  # no .run_config.json.tmp, no lock file

    os.remove(out.parent / "filler")
    assert main(argv) == 0
    assert len((out / "samples.jsonl").read_text().splitlines()) == 32
    assert json.loads((out / "results.json").read_text())["benchmarks"]["arith"]["metrics"]


def test_a_full_disk_at_the_lock_names_the_samples_already_stored(small_disk, tiny_model_path, bench_file, capsys):
    """With the disk full when the lock is taken, the message said "Kept: no samples yet" of a store holding 8."""
    out = small_disk(16) / "eval"
    argv = [
        "--model_name_or_path", tiny_model_path, "--benchmarks", bench_file, "--output_dir", str(out),
        "--backend", "transformers", "--no_progress", "--num_samples", "2", "--max_new_tokens", "4",
    ]  # fmt: skip
    assert main(argv) == 0
    stored = (out / "samples.jsonl").read_text()
    assert len(stored.splitlines()) == 8
    os.remove(out.parent / "filler")
    small_disk(0)
    capsys.readouterr()
    assert main([*argv, "--num_samples", "4"]) == 2
    err = capsys.readouterr().err
    assert f"opefo-eval: error: Cannot write {out}: its disk is full" in err and "Traceback" not in err
    assert f"Kept: the 8 samples stored in {out / 'samples.jsonl'}; no file of {out} is left half-written." in err
    assert (out / "samples.jsonl").read_text() == stored


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda s: [s], "config.json holds a JSON list, not a mapping of the model's settings"),
        (
            lambda s: {**s, "vocab_size": s["vocab_size"] + 64},
            "config.json says vocab_size=384, but the model.embed_tokens.weight of model.safetensors has 320 rows",
        ),
    ],
    ids=["list", "vocab_size"],
)
def test_a_model_config_that_does_not_fit_its_weights_is_one_line_before_loading(
    edit, message, tiny_model_path, bench_file, tmp_path, capsys, no_model_loading
):
    """S: a TypeError traceback while loading the tokenizer (a list), transformers' "mismatched sizes" RuntimeError
    after loading (vocab_size)."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_path, model)
    settings = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(edit(settings)))
    out = tmp_path / "eval"
    argv = ["--model_name_or_path", str(model), "--benchmarks", bench_file, "--output_dir", str(out)]
    assert main([*argv, "--backend", "transformers", "--no_progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("opefo-eval: error: ") and message in err and "Traceback" not in err
    assert "restore the config.json saved with these weights" in err.lower() and not out.exists()
