"""The divergence diagnosis: the re-run reproduces the demo's run exactly, and its per-step records agree with what
the trainer itself logged."""

import json
import math

import pytest

from opefo_trl.demo import run_demo
from opefo_trl.demo.diagnose import compare_histories, diagnose, main, token_classes

pytestmark = pytest.mark.slow

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_token_classes():
    assert token_classes(["0", "9", " 4", "<|im_end|>", "x", "12", " ", "a1"], "<|im_end|>") == [
        "digit", "digit", "digit", "end", "other", "other", "other", "other",
    ]  # fmt: skip


def test_compare_histories():
    row = {"step": 1, "entropy": 2.0, "reward": 0.5, "entropy_flow/lambda": 0.1, "grad_norm": 0.3}
    assert compare_histories([row], [dict(row)]) == 0.0
    assert compare_histories([row], [row | {"reward": 0.25}]) == 0.25
    assert compare_histories([row], [row | {"step": 2}]) == math.inf
    assert compare_histories([row], [{k: v for k, v in row.items() if k != "grad_norm"}]) == math.inf
    nan = row | {"entropy": float("nan")}
    assert compare_histories([nan], [dict(nan)]) == 0.0  # a run that diverged identically is reproduced


def test_diagnosis_reproduces_the_run_and_matches_its_log(tmp_path, tiny_settings):
    settings = tiny_settings(methods=["grpo", "opefo"], seeds=[0], pass_at_k_samples=0, output_dir=str(tmp_path))
    run_demo(str(tmp_path), settings, log=lambda _: None)
    for method in ("grpo", "opefo"):
        one = tiny_settings(methods=[method], seeds=[0], pass_at_k_samples=0, output_dir=str(tmp_path))
        (found,) = diagnose(one, log=print)
        assert found.reproduced is True and found.max_difference == 0.0
        data = json.loads((tmp_path / "diagnose" / "threads1" / f"{method}-seed0" / "diagnostics.json").read_text())
        assert (tmp_path / "diagnose" / "threads1" / f"{method}-seed0" / "diagnose.png").read_bytes()[:8] == PNG_MAGIC
        state = json.loads((tmp_path / "runs" / "threads1" / f"{method}-seed0" / "trainer_state.json").read_text())
        rows = [r for r in state["log_history"] if "entropy" in r]
        assert len(data["steps"]) == len(rows) == 2
        # Adam carries no momentum into its first step: that step's first-order change is all the batch's
        first = data["steps"][0]
        assert first["predicted_momentum"] == 0.0 and first["predicted_batch"] == first["predicted"] != 0.0
        assert data["steps"][1]["predicted_momentum"] != 0.0
        for record, row in zip(data["steps"], rows, strict=True):
            # the tabular lambda* the diagnosis recomputes is the one the trainer logged on the same batch
            assert record["lambda_tabular"] == pytest.approx(row["entropy_flow/lambda"], abs=1e-5)
            assert sum(c["token_share"] for c in record["classes"].values()) == pytest.approx(1.0)
            assert -1.0 <= record["lambda_param"] <= 1.0 and 0 <= record["sign_disagreement_tokens"] <= 1
            if method == "grpo":  # unweighted: the applied flow is the batch's own
                assert record["param_net_applied"] == pytest.approx(record["param_net_unweighted"])
                assert all(c["mean_weight"] in (None, 1.0) for c in record["classes"].values())
            else:  # OPEFO zeroes the tabular net flow of what it applies (the lambda* logged above)
                assert abs(record["tabular_net_applied"]) < 1e-5


def test_diagnose_refuses_what_it_cannot_diagnose(tmp_path, capsys):
    assert main(["--output_dir", str(tmp_path), "--methods", "grpo", "opefo"]) == 2
    assert "give one method" in capsys.readouterr().err
    assert main(["--output_dir", str(tmp_path), "--methods", "opefo", "--numerics", "threads1", "threads2"]) == 2
    assert "one numerics setting" in capsys.readouterr().err
    assert main(["--output_dir", str(tmp_path), "--methods", "opefo", "--numerics", "mkl_compatible"]) == 2
    assert "start it as `MKL_CBWR=COMPATIBLE python -m opefo_trl.demo.diagnose" in capsys.readouterr().err
    assert main(["--output_dir", str(tmp_path), "--methods", "opefo_param_step"]) == 2
    assert "already runs on the `param` estimate" in capsys.readouterr().err
    assert not (tmp_path / "models").exists()
