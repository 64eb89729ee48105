"""The GPU check runs every stage in its CPU reduced mode and reports the figures a first GPU run is judged by; a
failing stage does not stop the next, and the global deadline shrinks the last one."""

import importlib.util
import json
import os
import sys

import pytest

pytestmark = pytest.mark.slow

BENCHMARKS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCHMARKS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def reduced_check(tmp_path_factory):
    """One reduced run of all four stages (each in its own subprocess, as on a GPU machine; ~2 min on 2 cores,
    about half of it the three DeepSpeed launches of stage 2)."""
    pytest.importorskip("deepspeed")
    gpu_check = _load("gpu_check")
    out, work = tmp_path_factory.mktemp("gpu-check"), tmp_path_factory.mktemp("gpu-check-work")
    code = gpu_check.main(["--reduced", "true", "--output_dir", str(out), "--work_dir", str(work)])
    records = {s: json.loads((out / f"stage{s}.json").read_text()) for s in range(4)}
    return code, records, gpu_check.report_markdown(str(out)), out


@pytest.mark.slow
def test_every_stage_succeeds_and_writes_its_json_and_log(reduced_check):
    code, records, _, out = reduced_check
    assert {s: r["status"] for s, r in records.items()} == {0: "ok", 1: "ok", 2: "ok", 3: "ok"}, [
        r.get("log_tail") for r in records.values()
    ]
    assert code == 0
    assert sorted(p.name for p in out.iterdir()) == [f"stage{s}.{e}" for s in range(4) for e in ("json", "log")]


@pytest.mark.slow
def test_environment_stage_reports_versions_and_checks_the_fused_head(reduced_check):
    env = reduced_check[1][0]["results"]
    assert env["packages"]["trl"]["version"] == "1.16.0" and "version" in env["packages"]["deepspeed"]
    assert env["precision_settings"]["float32_matmul_precision"] in ("highest", "high", "medium")
    # fp32 log-softmax over 40,000 logits of |z| < ~15: rounding ~ 6e-8 x (|z| + log V) ~ 2e-6 per token.
    assert env["fused_head_smoke"]["max_logp_abs_error"] < 2e-5
    assert env["fused_head_smoke"]["max_entropy_abs_error"] < 2e-5


@pytest.mark.slow
def test_precision_stage_measures_each_mode_against_float64(reduced_check):
    precision = reduced_check[1][1]["results"]
    assert precision["warm_start"]["final_loss"] < precision["warm_start"]["first_loss"]
    assert precision["rollout"]["tokens"] == 16 * 16
    modes = precision["modes"]
    assert set(modes) == {"fp32", "bf16_autocast", "bf16_weights", "bf16_autocast_fp32_head", "bf16_weights_fp32_head"}
    assert modes["bf16_weights"]["dtypes"]["weights"] == "torch.bfloat16"
    assert modes["bf16_weights"]["dtypes"]["vocab_stats_compute"] == "torch.bfloat16"
    assert modes["bf16_autocast"]["dtypes"] == dict(
        weights="torch.float32", head="torch.float32", vocab_stats_compute="torch.bfloat16", autocast=True
    )
    for mode in ("bf16_autocast_fp32_head", "bf16_weights_fp32_head"):
        assert modes[mode]["dtypes"]["vocab_stats_compute"] == "torch.float32"
    fp32_logp_error = modes["fp32"]["per_token"]["logps"]["median_abs_error"]
    # fp32 against float64 on this tiny model: ~1e-7 nats per token; bf16 rounds logits to 2^-8 relative.
    assert fp32_logp_error < 1e-5
    for mode in ("bf16_autocast", "bf16_weights", "bf16_autocast_fp32_head", "bf16_weights_fp32_head"):
        assert modes[mode]["per_token"]["logps"]["median_abs_error"] > 10 * fp32_logp_error, mode
    # TRL's fp32 LM head removes the head's bf16 rounding: a smaller error than the bf16 head over the same backbone.
    auto, auto_fp32_head = modes["bf16_autocast"]["per_token"], modes["bf16_autocast_fp32_head"]["per_token"]
    assert auto_fp32_head["logps"]["median_abs_error"] < auto["logps"]["median_abs_error"]
    for estimate in ("opefo", "full"):
        fp32 = modes["fp32"]["estimates"][estimate]
        assert fp32["lambda_abs_error"] < 1e-5 and fp32["sign_agreement"] == 1.0
        assert fp32["lambda_star_reference"] == modes["bf16_weights"]["estimates"][estimate]["lambda_star_reference"]
        assert -1 < fp32["lambda_star_reference"] < 1 and fp32["increase_reference"] > 0
        assert len(fp32["block_lambda_abs_errors"]) == 2  # 16 completions in blocks of 8


@pytest.mark.slow
def test_precision_stage_runs_the_param_estimate_and_the_audit_floor_through_the_trainer(reduced_check):
    runs = reduced_check[1][1]["results"]["trainer_runs"]
    param = runs["param"]["metrics"]
    assert list(param) == ["1", "2"]
    for step in param.values():
        assert 0 <= step["entropy_flow/param_check_error"] < 1
        assert {"entropy_flow/predicted_delta", "entropy_flow/measured_delta", "entropy_flow/lambda"} <= set(step)
    # Learning rate 0: nothing moves; on a CPU the re-scored entropies are bit-identical.
    for name in ("floor_bf16_autocast", "floor_bf16_weights"):
        assert [m["entropy_flow/measured_delta"] for m in runs[name]["metrics"].values()] == [0.0, 0.0], name
    assert [m["entropy_flow/predicted_delta"] for m in runs["floor_bf16_autocast"]["metrics"].values()] == [0.0, 0.0]


@pytest.mark.slow
def test_zero3_stage_trains_checkpoints_resumes_and_runs_the_full_estimate(reduced_check):
    zero3 = reduced_check[1][2]["results"]
    assert (
        "-m accelerate.commands.launch --config_file recipes/accelerate/zero3.yaml --num_processes 1"
        in zero3["command"]
        and "--config recipes/qwen2.5-math-7b/opefo.yaml" in zero3["command"]
    )
    runs = zero3["runs"]
    assert [runs[n]["exit_code"] for n in ("train", "resume", "full")] == [0, 0, 0]
    assert runs["train"]["steps"] == [1, 2, 3] and runs["resume"]["steps"] == [4] and runs["full"]["steps"] == [1]
    lambdas = runs["train"]["lambda"] + runs["resume"]["lambda"] + runs["full"]["lambda"]
    assert all(-1 < lam < 1 for lam in lambdas) and any(lam != 0 for lam in lambdas)
    for run in runs.values():
        assert len(run["measured_delta"]) == len(run["steps"]) and all(g > 0 for g in run["grad_norm"])
        assert run["peak_memory_bytes"] > 0 and run["median_step_time"] > 0 and run["train_runtime"] > 0
    files = runs["resume"]["files"]
    assert "checkpoint-3/global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt" in files
    assert "checkpoint-3/opefo_method_state.json" in files and "model.safetensors" in files


@pytest.mark.slow
def test_cost_stage_times_every_configuration_against_grpo(reduced_check):
    cost = reduced_check[1][3]["results"]
    timed = cost["cost"]["accumulation_2"]
    assert list(timed) == ["grpo_strict", "opefo", "opefo_full", "opefo_param", "opefo_param_step"]
    assert timed["grpo_strict"]["time_ratio"] == 1.0 and all(m["time_ratio"] > 0 for m in timed.values())
    # on top of GRPO's passes, per micro-batch (2): the estimate's gradient forward and its forward-mode pass
    assert timed["opefo_param"]["extra_backbone_passes"] == 4
    assert cost["cost_settings"]["gradient_checkpointing"] is True
    memory = cost["memory"]["accumulation_2"]
    assert list(memory) == ["grpo_strict", "opefo_full", "opefo_param", "opefo_param_lora16"]
    assert all(m["peak_total_bytes"] > 0 and m["memory_ratio"] > 0 for m in memory.values())


@pytest.mark.slow
def test_report_names_every_figure(reduced_check):
    report = reduced_check[2]
    for text in (
        "## Stage 0: environment", "fused-head smoke test", "| trl | 1.16.0 |",
        "### `opefo` estimate vs float64", "### `full` estimate vs float64", "sign agreement", "P rel error",
        "| bf16_weights_fp32_head |", "entropy_flow/param_check_error", "entropy_flow/predicted_delta",
        "OPEFOTrainer run `floor_bf16_weights`", "lambda* per step", "measured change per step",
        "grad norm per step", "peak memory GiB", "checkpoint-3/global_step3/", "| opefo_param_step |",
        "| opefo_param_lora16 |", "peak GiB (absolute)",
    ):  # fmt: skip
        assert text in report, text


def test_a_failing_stage_does_not_stop_the_next_and_the_deadline_shrinks_the_last(tmp_path):
    gpu_check = _load("gpu_check")
    argv = ["--reduced", "true", "--output_dir", str(tmp_path), "--work_dir", str(tmp_path / "work")]
    code = gpu_check.main([*argv, "--stages", "0", "3", "--deadline_s", "6", "--timeouts", "0=0.5"])
    assert code == 1
    first, last = (json.loads((tmp_path / f"stage{s}.json").read_text()) for s in (0, 3))
    assert first["status"] == "timeout" and first["timeout_s"] == 0.5
    assert 5 <= last["timeout_s"] < 6  # what the deadline left, not its own 600 s
    # Within those seconds the stage either is stopped (a slow machine: its imports alone take longer) or stops its
    # own work at its deadline and reports every configuration as not run (a fast one); it never runs past it.
    assert last["status"] in ("timeout", "ok") and last["seconds"] < 6
    report = gpu_check.report_markdown(str(tmp_path))
    assert f"| 3 cost | {last['status']} |" in report
    if last["status"] == "ok":
        assert "Not run (deadline): every configuration" in report


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--timeouts", "5=10"], "--timeouts takes STAGE=SECONDS"),
        (["--stages", "4"], "Unknown stage(s) [4]"),
    ],
)
def test_bad_options_are_refused_before_anything_runs(tmp_path, capsys, argv, message):
    gpu_check = _load("gpu_check")
    assert gpu_check.main(["--output_dir", str(tmp_path / "out"), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_gpu_stages_are_refused_on_a_machine_without_a_gpu_unless_reduced(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    gpu_check = _load("gpu_check")
    assert gpu_check.main(["--output_dir", str(tmp_path), "--stages", "1"]) == 2
    assert "no CUDA device: stages [1] are for a GPU machine" in capsys.readouterr().err


def test_precision_settings_refuse_unknown_modes_and_ragged_groups():
    precision = _load("precision")
    with pytest.raises(ValueError, match=r"Unknown precision mode\(s\) \['bf8'\]"):
        precision.PrecisionSettings(modes=["bf8"])
    with pytest.raises(ValueError, match="multiples of num_generations"):
        precision.PrecisionSettings(completions=12, num_generations=8)


def test_chain_task_is_reproducible_and_walks_only_along_its_transitions():
    import torch

    from opefo_trl.testing import build_tiny_tokenizer

    precision = _load("precision")
    tokenizer = build_tiny_tokenizer()
    settings = precision.PrecisionSettings(vocab_size=1024, chain_states=32, max_successors=8)
    torch.manual_seed(1)
    task = precision.ChainTask.build(settings, tokenizer)
    torch.manual_seed(2)  # the global random state must not matter
    again = precision.ChainTask.build(settings, tokenizer)
    assert torch.equal(task.probs, again.probs) and torch.equal(task.successors, again.successors)
    assert task.prompts == again.prompts and len({len(ids) for ids in task.prompt_ids.tolist()}) == 1
    assert bool((task.states >= len(tokenizer)).all()) and torch.allclose(task.probs.sum(1), torch.ones(32))
    entropy = task.entropy()
    assert float(entropy.min()) == 0.0 and 1.0 < float(entropy.max()) <= torch.log(torch.tensor(8.0))
    walk = task.sample(6, 20, torch.Generator().manual_seed(0))
    index = {int(token): i for i, token in enumerate(task.states)}
    for row in walk.tolist():
        for a, b in zip(row, row[1:], strict=False):
            successors = task.successors[index[a]][task.probs[index[a]] > 0]
            assert index[b] in successors.tolist()


def test_group_advantages_match_trl_scale_rewards_group():
    import torch

    precision = _load("precision")
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.2, 0.4, 0.6, 0.8])
    advantages = precision.group_advantages(rewards, 4)
    first = rewards[:4]
    assert torch.allclose(advantages[:4], (first - first.mean()) / (first.std() + 1e-4))
    assert torch.allclose(advantages.view(2, 4).sum(1), torch.zeros(2), atol=1e-6)


def test_bench_step_refuses_unknown_configurations_with_the_valid_ones(capsys):
    bench_step = _load("bench_step")
    assert bench_step.main(["--configs", "opefo_parm"]) == 2
    assert "Unknown configuration(s) ['opefo_parm']; choose among" in capsys.readouterr().err


def test_bench_step_takes_one_model_folder_and_drops_the_tiny_tokenizers_task_tokens(capsys):
    bench_step = _load("bench_step")
    assert bench_step.main(["--real_model", "--model_path", "some/folder"]) == 2
    assert "Give --real_model or --model_path, not both." in capsys.readouterr().err
    settings = bench_step.BenchSettings(model_path="some/folder", configs=["opefo_param_step_task", "opefo"])
    assert settings.configs == ["grpo_strict", "opefo"]
    assert bench_step.build_model(settings, "unused") == "some/folder"
