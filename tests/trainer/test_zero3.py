"""OPEFO under DeepSpeed ZeRO-3 with two processes on CPU, launched like a real run:
`accelerate launch --config_file recipes/accelerate/zero3.yaml --num_processes 2 ... opefo-train --config <recipe>`.

Checks that lambda* (computed from entropy-flow sums all-reduced over ranks) is identical on both ranks, that the
checkpoint holds ZeRO-3 shards of both ranks plus the method state, and that `--resume_from_checkpoint true`
continues from it. Slow (two multi-process launches, ~30-60 s on 2 cores): marked `slow`, still in the default run.
"""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
RECIPE = os.path.join(REPO, "recipes", "qwen2.5-math-7b", "opefo.yaml")
ZERO3 = os.path.join(REPO, "recipes", "accelerate", "zero3.yaml")

# The entry point, run by `accelerate launch`. DeepSpeed's CPU backend would first JIT-compile a shared-memory
# all-reduce kernel used only for inference (~1 min, needs a C++ compiler); training collectives go through gloo
# either way, so the test skips that build.
LAUNCHER = """
import sys

import deepspeed.ops

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

from opefo_trl.cli.train import main

sys.exit(main(sys.argv[1:]))
"""

REWARDS = """
def digit_overlap_reward(completions, solution, **kwargs):
    return [sum(d in c[-1]["content"] for d in set(s)) / len(set(s)) for c, s in zip(completions, solution)]


def token_sum_reward(completion_ids, **kwargs):
    return [float(sum(ids) % 3) for ids in completion_ids]
"""

pytestmark = pytest.mark.slow


def _launch(tmp_path, tiny_model_path, data_file, output_dir, *extra):
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        ZERO3,
        "--num_processes",
        "2",
        "--mixed_precision",
        "no",
        str(tmp_path / "launch_opefo_train.py"),
        "--config",
        RECIPE,
        "--model_name_or_path",
        tiny_model_path,
        "--dataset_files",
        data_file,
        "--output_dir",
        output_dir,
        "--use_vllm",
        "false",
        "--bf16",
        "false",
        "--use_cpu",
        "true",
        "--report_to",
        "none",
        "--num_generations",
        "2",
        "--per_device_train_batch_size",
        "4",
        "--gradient_accumulation_steps",
        "2",
        "--max_completion_length",
        "8",
        "--save_steps",
        "1",
        "--metrics_jsonl",
        "every_process",
        "--reward_funcs",
        "math_accuracy_reward",
        "opefo_zero3_rewards.digit_overlap_reward",
        *extra,
    ]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "DS_BUILD_OPS": "0",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(tmp_path), REPO, os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + _without_warnings(result.stderr)[-8000:]
    return result


def _without_warnings(stderr: str) -> str:
    """stderr without the deprecation warnings every rank prints (two lines each), so that a failure shows its cause."""
    lines, kept = stderr.splitlines(), []
    for line, previous in zip(lines, [""] + lines[:-1], strict=True):
        if "Warning:" not in line and "Warning:" not in previous:
            kept.append(line)
    return "\n".join(kept)


def _write_launcher_rewards_and_data(tmp_path):
    """The launcher script, the reward module and a 16-problem JSONL file; returns the data file's path."""
    (tmp_path / "launch_opefo_train.py").write_text(LAUNCHER)
    (tmp_path / "opefo_zero3_rewards.py").write_text(REWARDS)
    data_file = tmp_path / "problems.jsonl"
    with open(data_file, "w") as f:
        for i in range(16):
            f.write(json.dumps({"prompt": f"What is {i + 2} + {3 * i + 1}?", "solution": str(4 * i + 3)}) + "\n")
    return data_file


def _rank_metrics(output_dir, rank):
    with open(os.path.join(output_dir, f"metrics.rank{rank}.jsonl")) as f:
        return [m for m in map(json.loads, f) if "entropy_flow/lambda" in m]


def test_opefo_zero3_two_processes_lambda_checkpoint_resume(tmp_path, tiny_model_path):
    pytest.importorskip("deepspeed")
    data_file = _write_launcher_rewards_and_data(tmp_path)
    out = str(tmp_path / "run")

    _launch(tmp_path, tiny_model_path, str(data_file), out, "--max_steps", "2")
    rank0, rank1 = _rank_metrics(out, 0), _rank_metrics(out, 1)
    assert [m["step"] for m in rank0] == [1, 2] and [m["step"] for m in rank1] == [1, 2]
    lambdas = [m["entropy_flow/lambda"] for m in rank0]
    assert lambdas == [m["entropy_flow/lambda"] for m in rank1]  # bit-identical: computed from all-reduced sums
    assert any(lam != 0.0 for lam in lambdas) and all(-1.0 < lam < 1.0 for lam in lambdas)
    assert all("opefo/lambda_applied" not in m for m in rank0)  # the lambda applied is lambda*, logged above
    for m in rank0:
        assert "rewards/digit_overlap_reward/mean" in m and m["rewards/math_accuracy_reward/failures"] == 0

    # The checkpoint holds ZeRO-3 optimizer shards of both ranks and OPEFO's method state.
    shards = os.path.join(out, "checkpoint-2", "global_step2")
    assert sorted(n for n in os.listdir(shards) if n.endswith("optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    import torch

    saved = torch.load(
        os.path.join(shards, "zero_pp_rank_0_mp_rank_00_optim_states.pt"), map_location="cpu", weights_only=False
    )
    assert saved["ds_config"]["zero_optimization"]["stage"] == 3
    assert saved["optimizer_state_dict"]["partition_count"] == 2
    with open(os.path.join(out, "checkpoint-2", "opefo_method_state.json")) as f:
        assert json.load(f)["method"] == "opefo"
    assert os.path.isfile(os.path.join(out, "model.safetensors"))  # consolidated weights (zero3_save_16bit_model)

    # Resume from the last checkpoint: the run continues at step 3 (not step 1) on both ranks.
    _launch(tmp_path, tiny_model_path, str(data_file), out, "--max_steps", "3", "--resume_from_checkpoint", "true")
    for rank in (0, 1):
        assert [m["step"] for m in _rank_metrics(out, rank)] == [1, 2, 3]
    assert _rank_metrics(out, 0)[2]["entropy_flow/lambda"] == _rank_metrics(out, 1)[2]["entropy_flow/lambda"]
    with open(os.path.join(out, "checkpoint-3", "trainer_state.json")) as f:
        assert json.load(f)["global_step"] == 3


def test_full_estimate_under_zero3_gathers_the_lm_head(tmp_path):
    """The `full` estimate re-projects hidden states through the LM head, which ZeRO-3 shards to size 0 outside its
    module's forward: the vocabulary pass must gather it, and the two ranks must still agree on lambda*."""
    pytest.importorskip("deepspeed")
    from opefo_trl.testing import build_tiny_model

    # 4096 x 64 head: above ZeRO-3's persistence threshold (1e5 elements), so it really is partitioned.
    tiny_model_path = build_tiny_model(tmp_path / "model", vocab_size=4096)
    data_file = _write_launcher_rewards_and_data(tmp_path)
    out = str(tmp_path / "run")
    # Most ids of the padded vocabulary decode to no text: reward the ids themselves, so advantages are not all 0.
    _launch(
        tmp_path,
        tiny_model_path,
        str(data_file),
        out,
        "--max_steps",
        "1",
        "--entropy_flow_estimate",
        "full",
        "--save_strategy",
        "no",
        "--reward_funcs",
        "opefo_zero3_rewards.token_sum_reward",
    )
    (rank0,), (rank1,) = _rank_metrics(out, 0), _rank_metrics(out, 1)
    assert rank0["entropy_flow/lambda"] == rank1["entropy_flow/lambda"]
    assert rank0["entropy_flow/increase"] > 0 and rank0["entropy_flow/decrease"] > 0, rank0
    assert abs(rank0["opefo/weighted_net"]) <= 1e-5 * (rank0["entropy_flow/increase"] + rank0["entropy_flow/decrease"])
