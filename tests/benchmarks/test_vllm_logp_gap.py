"""benchmarks/vllm_logp_gap.py: its lambda* figures from made-up log-probs (no engine: the run itself is
`python benchmarks/vllm_logp_gap.py` in .venv-vllm), and its refusals."""

import math

import pytest
import torch
from conftest import load_benchmark

vllm_logp_gap = load_benchmark("vllm_logp_gap")


def batch(seed, rows=8, length=6):
    gen = torch.Generator().manual_seed(seed)
    logps = -torch.rand(rows, length, generator=gen) * 4
    entropies = torch.rand(rows, length, generator=gen) * 3
    mask = torch.ones(rows, length)
    mask[0, -2:] = 0  # padding
    advantages = torch.randn(rows, generator=gen)
    return logps, entropies, mask, advantages


def test_with_vllms_own_log_probs_every_lambda_is_the_trainers():
    logps, entropies, mask, advantages = batch(0)
    figures = vllm_logp_gap.lambda_stars(logps, logps.clone(), entropies, mask, advantages)
    values = list(figures["lambda_star"].values())
    assert values == pytest.approx([values[0]] * 4, abs=1e-7) and values[0] != 0
    assert figures["sequences_masked"] == 0 and figures["sequence_log_ratio"] == [0.0] * 8


@pytest.mark.parametrize("seed", range(5))
def test_trls_sequence_ratio_moves_lambda_by_at_most_its_largest_log(seed):
    """docs/algorithm.md section 6: weighting each completion's flow by rho_i in [e^-d, e^d] moves lambda* by <= d,
    and a completion with rho_i > 3 weighs nothing (TRL's sequence_mask)."""
    logps, entropies, mask, advantages = batch(seed)
    gen = torch.Generator().manual_seed(100 + seed)
    vllm_logps = logps + 0.05 * torch.randn(logps.shape, generator=gen)
    figures = vllm_logp_gap.lambda_stars(logps, vllm_logps, entropies, mask, advantages)
    lambdas, log_ratios = figures["lambda_star"], torch.tensor(figures["sequence_log_ratio"])
    assert figures["sequences_masked"] == int((log_ratios > math.log(3)).sum()) == 0
    d = float(log_ratios.abs().max())
    shift = abs(lambdas["sequence_mask_default"] - lambdas["trainer_logps_no_correction"])
    assert 0 < shift <= d + 1e-6

    # A completion pushed past the clip weighs 0: lambda* is that of the batch without it.
    vllm_logps[3] -= 1.0
    masked = vllm_logp_gap.lambda_stars(logps, vllm_logps, entropies, mask, advantages)
    assert masked["sequences_masked"] == 1
    keep = torch.arange(8) != 3
    rest = vllm_logp_gap.lambda_stars(logps[keep], vllm_logps[keep], entropies[keep], mask[keep], advantages[keep])
    assert masked["lambda_star"]["sequence_mask_default"] == pytest.approx(
        rest["lambda_star"]["sequence_mask_default"], abs=1e-6
    )


@pytest.mark.parametrize("flag", ["--generations=1", "--temperature=0", "--max_tokens=0", "--dtype=float16"])
def test_bad_options_are_refused_before_any_engine_starts(flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        vllm_logp_gap.parse([flag])
    assert exit_info.value.code == 2
    assert "vllm_logp_gap.py: error:" in capsys.readouterr().err
