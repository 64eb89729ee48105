"""benchmarks/step_balance.py runs end to end and reports what the real AdamW step did (a reduced run)."""

import json

import pytest
from conftest import load_benchmark

pytestmark = [pytest.mark.slow, pytest.mark.numerics]


step_balance = load_benchmark("step_balance")


def test_the_step_balance_benchmark_reports_the_real_steps(tmp_path, capsys):
    output = tmp_path / "step_balance.json"
    argv = ["--steps", "2", "--learning_rates", "1e-5", "--dtype", "float64", "--output_json", str(output)]
    assert step_balance.main([*argv, "--probe_rollouts", "2", "--probe_prompts", "2", "--held_out", "8"]) == 0
    result = json.loads(output.read_text())
    runs = result["runs"]["1e-05"]
    assert len(runs["grpo"]["measured"]) == len(runs["step_balance"]["first_order"]) == 2
    assert sorted(runs) == ["fixed_probe_balance", "grpo", "probe_balance", "step_balance"]
    assert all(len(r["held_out"]) == 2 and r["held_out"][0] != 0.0 for r in runs.values())
    assert runs["grpo"]["held_out"][0] != runs["step_balance"]["held_out"][0]
    summary = result["summary"]["1e-05"]
    # float64: the balanced step's first order is the root search's residual, far below GRPO's on the same batch.
    assert summary["max_first_order_over_grpo_same_batch"] <= 1e-3
    assert summary["step1_measured_grpo"] == pytest.approx(runs["grpo"]["first_order"][0], rel=0.05)
    out = capsys.readouterr().out
    assert (
        "| step | GRPO measured |" in out
        and "| step | grpo | step_balance | probe_balance | fixed_probe_balance |" in out
    )


def test_bad_settings_are_refused_before_any_work(capsys):
    assert step_balance.main(["--dtype", "bfloat16"]) == 2
    assert "dtype must be 'float32' or 'float64'" in capsys.readouterr().err
    assert step_balance.main(["--probe_rollouts", "1"]) == 2
    assert "probe_rollouts must be 0 or >= 2" in capsys.readouterr().err


def test_the_held_out_re_score_is_float64_whatever_trl_did_to_the_model(tiny_model_path, keep_dtype_rms_norm):
    """The trained model carries TRL's fused head with its float32 head cast (what GRPOTrainer adds): the held-out
    re-score must still be a float64 forward of the same weights, equal to an independent float64 model's full
    softmax (the same operations in float64: ~1e-16; bound 1e-13). A deep copy cast to float64 keeps TRL's cast and
    computes the logits in float32, ~1e-7 off."""
    import torch
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    held_out = step_balance.HeldOut.sample(tiny_model_path, 8, step_balance.TRAINING_PROMPTS, seed=0)
    trained = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    with torch.no_grad():
        for p in trained.parameters():
            p.mul_(1 + 0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    add_fused_lm_head(trained, temperature=1.0, cast_lm_head_to_fp32=True, outputs=("log_probs", "entropy"))
    reference = keep_dtype_rms_norm(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float64))
    with torch.no_grad():
        for p, q in zip(reference.parameters(), trained.parameters(), strict=True):
            p.copy_(q)
        logits = reference(input_ids=held_out.input_ids, attention_mask=held_out.attention_mask).logits
    logp = torch.log_softmax(logits[:, held_out.prompt_length - 1 : -1], -1)
    mask = held_out.completion_mask.double()
    expected = float((-(logp.exp() * logp).sum(-1) * mask).sum() / mask.sum())
    assert held_out.entropy(trained) == pytest.approx(expected, rel=0, abs=1e-13)
