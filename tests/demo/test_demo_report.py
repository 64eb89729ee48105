"""The demo's report: the pre-registered failure rule, all-runs vs non-failed figures, the readings per numerics
setting, the tables and summary.json."""

import json
import math
import statistics

import pytest

from opefo_trl.demo import DemoSettings, HeldOutResult, RunResult, failure_reason
from opefo_trl.demo.report import (
    MethodSummary,
    identical_runs,
    is_above,
    readings,
    seeds_needed,
    summarize,
    summary_dict,
    summary_markdown,
    versus_baseline,
)


def _result(method, seed, entropy_final=2.0, reward_final=0.7, numerics="threads1", entropy_start=2.2, held_out=True):
    return RunResult(
        method=method,
        seed=seed,
        numerics=numerics,
        run_dir=f"runs/{numerics}/{method}-seed{seed}",
        flow_estimate="param" if method == "opefo_param_step" else "opefo",
        steps=8,
        seconds=10.0,
        cpu_seconds=8.0,
        entropy_start=entropy_start,
        entropy_final=entropy_final,
        entropy_min=min(entropy_final, entropy_start),
        reward_start=0.5,
        reward_final=reward_final,
        lambda_mean=0.02,
        lambda_abs_mean=0.04,
        net_over_gross_mean=0.04,
        measured_delta_mean=-1e-3,
        measured_abs_delta_mean=4e-3,
        held_out=HeldOutResult.from_counts([1, 2], 4, [1, 2], [1, 1], [1, 4]) if held_out else None,
        log_fingerprint=f"{method}-{seed}-{entropy_final}-{reward_final}",
    )


@pytest.mark.parametrize(
    "entropy_final, reward_final, failed",
    [
        (2.0, 0.7, None),
        (2.0, 0.1, "final reward 0.100 <= 0.1"),  # the bound itself fails
        (2.0, 0.10001, None),
        (3.3, 0.7, None),  # exactly 1.5x the start (2.2) does not
        (3.31, 0.7, "final entropy 3.310 > 1.5 x start 2.200"),
        (float("nan"), 0.7, "not finite"),
        (2.0, float("inf"), "not finite"),
    ],
)
def test_failure_rule(entropy_final, reward_final, failed):
    reason = failure_reason(_result("opefo", 0, entropy_final, reward_final))
    assert reason == failed if failed is None else failed in reason


def test_non_failed_figures_beside_all_runs():
    runs = [_result("opefo", 0, 2.0, 0.6), _result("opefo", 1, 5.6, 0.0), _result("opefo", 2, 2.2, 0.8)]
    s = MethodSummary.of(runs)
    assert list(s.failures) == [1] and "reward" in s.failures[1]
    assert s.all_runs["reward_final"].mean == pytest.approx(statistics.fmean([0.6, 0.0, 0.8]))
    assert s.all_runs["reward_final"].std == pytest.approx(statistics.stdev([0.6, 0.0, 0.8]))
    assert s.non_failed["reward_final"].mean == pytest.approx(0.7) and s.non_failed["reward_final"].n == 2
    assert s.values["entropy_final"] == [2.0, 2.2]
    assert s.all_runs["entropy_ratio"].mean == pytest.approx(statistics.fmean([2.0 / 2.2, 5.6 / 2.2, 1.0]))
    assert s.all_runs["pass@1"].mean == pytest.approx(3 / 8)  # (1/4 + 2/4) / 2 on every run


def test_is_above_uses_two_standard_errors():
    baseline = [1.0, 1.1, 0.9]  # mean 1.0, variance 0.01
    # standard error sqrt(0.01/3 + 0.01/3) = 0.0816: a difference of 0.17 counts, 0.15 does not
    assert is_above([1.17 + d for d in (-0.1, 0.0, 0.1)], baseline) == "above"
    assert is_above([1.15 + d for d in (-0.1, 0.0, 0.1)], baseline) == "no difference shown"
    assert is_above([0.83 + d for d in (-0.1, 0.0, 0.1)], baseline) == "below"
    assert is_above([2.0], baseline) == "too few runs"


def test_a_direction_on_fewer_seeds_than_the_power_analysis_asks_is_reported_underpowered():
    # 0.17 apart with spreads 0.1: above 2 standard errors (0.163 at 3 seeds), but deciding it with power 0.8 takes
    # n >= (2 + 0.8416)^2 (0.1^2 + 0.1^2) / 0.17^2 = 5.58 seeds, so 6.
    three, baseline = [0.67, 0.57, 0.77], [0.5, 0.6, 0.4]
    assert is_above(three, baseline) == "above"
    assert versus_baseline(three, baseline) == ("underpowered", 6) and seeds_needed(0.17, 0.1, 0.1) == 6
    assert versus_baseline([x - 0.34 for x in three], baseline) == ("underpowered", 6)  # below: no direction either
    # 8 seeds of the same values: spreads sqrt(8/7) x 0.1, so 7 needed, and 8 run: the direction stands.
    assert versus_baseline([0.57, 0.77] * 4, [0.4, 0.6] * 4) == ("above", 7)
    # Just over 2 standard errors on 16 seeds (0.075 > 0.073) would need 31, but the pre-registered 16 decide it.
    assert seeds_needed(0.075, 0.1 * (16 / 15) ** 0.5, 0.1 * (16 / 15) ** 0.5) == 31
    assert versus_baseline([0.175, -0.025] * 8, [0.1, -0.1] * 8) == ("above", 16)
    # 12 seeds, 0.1 apart (2.35 standard errors): 18 needed, capped at 16, and 12 are fewer.
    assert versus_baseline([0.2, 0.0] * 6, [0.1, -0.1] * 6) == ("underpowered", 16)
    assert versus_baseline([1.15, 1.05, 1.25], [1.0, 1.1, 0.9]) == ("no difference shown", None)  # 0.15 < 0.163


def test_the_report_states_no_direction_from_an_underpowered_comparison():
    grpo = [_result("grpo", seed, reward_final=r) for seed, r in enumerate([0.5, 0.6, 0.4])]
    opefo = [_result("opefo", seed, reward_final=r) for seed, r in enumerate([0.67, 0.57, 0.77])]
    settings = DemoSettings(seeds=[0, 1, 2], methods=["grpo", "opefo"], pass_at_k=[1, 4])
    table = summary_markdown(grpo + opefo, settings, {"threads1": None})
    row = _by_line(table, "| 4. opefo vs GRPO on reward_final")
    assert "| underpowered (0.670 vs 0.500; 3 seeds, 6 needed) | underpowered |" in row and "above" not in row
    assert "no direction is stated. Rerun with `--seeds` as many as the reading says are needed." in table
    found = summary_dict(grpo + opefo, settings, {"threads1": None})["readings"]
    assert next(r for r in found if r["reading"].startswith("4. opefo vs GRPO on reward"))["holds"] == "underpowered"


def _by_text(found, start):
    return next(r for r in found if r.text.startswith(start))


def test_readings_are_decided_per_setting_and_hold_only_in_both():
    results = []
    for numerics in ("threads1", "mkl_compatible"):
        for seed in range(3):
            results.append(_result("grpo", seed, 0.8 + 0.01 * seed, 0.74 + 0.01 * seed, numerics))
            # OPEFO holds entropy under threads1; under mkl_compatible seed 1 diverges
            diverged = numerics == "mkl_compatible" and seed == 1
            results.append(_result("opefo", seed, 5.6 if diverged else 2.1, 0.0 if diverged else 0.6, numerics))
    found = readings(summarize(results), [1, 4])
    regime = _by_text(found, "1. regime")
    assert regime.verdicts == {"threads1": "yes", "mkl_compatible": "yes"} and regime.holds == "yes"
    holds = _by_text(found, "2. opefo holds entropy")
    assert holds.verdicts == {"threads1": "yes", "mkl_compatible": "no"} and holds.holds == "differs between settings"
    assert _by_text(found, "2. grpo holds entropy").holds == "no"
    fails = _by_text(found, "3. opefo fails")
    assert fails.verdicts == {"threads1": "no", "mkl_compatible": "yes"} and fails.cell("mkl_compatible") == "yes (1/3)"
    reward = _by_text(found, "4. opefo vs GRPO on reward_final")
    assert reward.holds == "below"  # 0.6 vs ~0.75 over the non-failed runs, in both settings
    assert _by_text(found, "4. opefo vs GRPO on pass@1").holds == "no difference shown"  # identical pass@k


def test_table_and_summary_json(tmp_path):
    results = [_result("grpo", 0, 0.8), _result("grpo", 1, 1.0), _result("opefo", 0, 5.6, 0.0), _result("opefo", 1)]
    results += [_result("opefo_param_step", 0), _result("opefo_param_step", 1)]
    settings = DemoSettings(seeds=[0, 1], methods=["grpo", "opefo", "opefo_param_step"], pass_at_k=[1, 4])
    warm = {"threads1": HeldOutResult.from_counts([1, 2], 4, [0, 1], [0, 1], [1, 4])}
    table = summary_markdown(results, settings, warm)
    grpo_row = next(line for line in table.splitlines() if line.startswith("| grpo ("))
    opefo_row = next(line for line in table.splitlines() if line.startswith("| opefo ("))
    assert "| 0 / 2 |" in grpo_row and "0.900 ± 0.141" in grpo_row  # mean and sample std of 0.8 and 1.0
    assert "(`opefo`)" in grpo_row and "-1.00e-03" in grpo_row and "4.00e-03" in grpo_row  # signed and |ΔH|
    assert "| 1 / 2 |" in opefo_row and "(non-failed: 2.000)" in opefo_row
    assert "(`param`)" in next(line for line in table.splitlines() if line.startswith("| opefo_param_step ("))
    assert "| warm start (before RL) | 0.125 | 0.500 | 0.50 |" in table
    assert "Failed runs: opefo seed 0 (final reward 0.000 <= 0.1)." in table
    assert "\\|λ*\\|" in _by_line(table, "| 1. regime")  # escaped inside the table
    data = json.loads(json.dumps(summary_dict(results, settings, warm)))
    assert data["summary"]["threads1"]["opefo"]["failures"] == {"0": "final reward 0.000 <= 0.1"}
    assert data["summary"]["threads1"]["opefo"]["non_failed"]["entropy_final"]["n"] == 1
    assert [r["failure"] is not None for r in data["runs"]] == [False, False, True, False, False, False]
    assert data["warm_start"]["threads1"]["pass_at_k"] == {"pass@1": 0.125, "pass@4": 0.5}
    assert data["criteria"]["failed_reward_at_most"] == 0.1 and data["held_out_targets"][0] == 101
    assert not any(math.isnan(v) for r in data["runs"] for v in r.values() if isinstance(v, float))


def _by_line(table, start):
    return next(line for line in table.splitlines() if line.startswith(start))


def test_settings_with_identical_logs_are_reported_as_one():
    same = [_result("grpo", s, numerics=n) for n in ("threads1", "threads2") for s in (0, 1)]
    assert identical_runs(same) == {("threads1", "threads2"): (2, 2)}
    other = same + [_result("grpo", 0, entropy_final=1.9, numerics="mkl_compatible")]
    assert identical_runs(other)[("threads1", "mkl_compatible")] == (0, 1)
    table = summary_markdown(same, DemoSettings(seeds=[0, 1], methods=["grpo"], pass_at_k=[1, 4]), {})
    assert "Numerics threads1 and threads2: 2 of 2 runs gave identical logs. They are one setting" in table


def test_pretrained_readings_a_to_d_replace_the_regime_reading():
    results = []
    for seed in range(3):
        grpo = _result("grpo", seed, entropy_final=0.5 + 0.01 * seed, entropy_start=0.6)  # falls to ~0.85x
        grpo.increase_mean, grpo.decrease_mean = 1.0, 1.5 + seed  # N > P
        opefo = _result("opefo", seed, entropy_final=0.6 + 0.01 * seed, entropy_start=0.6)  # ~1.0x
        opefo.increase_mean, opefo.decrease_mean = 1.0, 1.0
        results += [grpo, opefo]
    found = readings(summarize(results), [1, 4], pretrained=True)
    assert not [r for r in found if r.text.startswith("1.")]
    small = _by_text(found, "a. λ* small")
    assert small.verdicts == {"threads1": "yes"} and small.cell("threads1") == "yes (|λ*| 0.0400)"  # <= 0.05
    assert _by_text(found, "b. GRPO's decrease flow").cell("threads1") == "yes (N 2.5 vs P 1)"
    assert _by_text(found, "c. GRPO's entropy falls").cell("threads1") == "yes (0.850x)"
    falls_less = _by_text(found, "d. OPEFO's entropy falls less")
    assert falls_less.verdicts == {"threads1": "yes"} and "1.017x vs 0.850x" in falls_less.cell("threads1")
    for r in results:
        if r.method == "grpo":
            r.lambda_abs_mean, r.decrease_mean, r.entropy_final = 0.3, 0.5, 0.7  # |λ*| large, P > N, entropy up
    found = readings(summarize(results), [1, 4], pretrained=True)
    assert [_by_text(found, f"{x}.").verdicts["threads1"] for x in "abcd"] == ["no", "no", "no", "no"]
    table = summary_markdown(
        results, DemoSettings(task="word_problems", seeds=[0, 1, 2], methods=["grpo", "opefo"]), {}
    )
    assert "The pretrained SmolLM2-135M-Instruct (30 layers" in table and "| a. λ* small" in table
