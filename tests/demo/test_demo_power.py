"""opefo_trl.demo.power: the seeds the comparison rule needs, and the table of a demo's summary.json."""

import json
import math
import random
import statistics

import pytest

from opefo_trl.demo.power import main, power_table, seeds_needed
from opefo_trl.demo.report import is_above


def test_the_seeds_needed_decide_the_comparison_that_often():
    """Simulated seeds (normal, the differences and spreads of a demo): with the number seeds_needed returns, the
    report's own rule decides 'above' in about 80% of repeats; with half as many, far less often."""
    rng = random.Random(0)
    difference, std, baseline_std = 0.15, 0.12, 0.14
    n = seeds_needed(difference, std, baseline_std)
    assert n == math.ceil((2 + statistics.NormalDist().inv_cdf(0.8)) ** 2 * (std**2 + baseline_std**2) / difference**2)

    def decided(seeds):
        wins = 0
        for _ in range(2000):
            mine = [rng.gauss(difference, std) for _ in range(seeds)]
            theirs = [rng.gauss(0.0, baseline_std) for _ in range(seeds)]
            wins += is_above(mine, theirs) == "above"
        return wins / 2000

    assert decided(n) == pytest.approx(0.8, abs=0.05)
    assert decided(max(2, n // 2)) < 0.6
    assert seeds_needed(0.0, 0.1, 0.1) is None and seeds_needed(-0.5, 0.01, 0.01) == 2


def test_the_table_of_a_summary_and_the_command(tmp_path, capsys):
    summary = {
        "summary": {
            "threads1": {
                "grpo": {"non_failed": {"pass@64": {"mean": 0.6, "std": 0.1, "n": 5}}},
                "opefo": {"non_failed": {"pass@64": {"mean": 0.8, "std": 0.1, "n": 5}}},
                "one_run": {"non_failed": {"pass@64": {"mean": 0.8, "std": None, "n": 1}}},
            }
        }
    }
    (row,) = power_table(summary)
    assert row["method"] == "opefo" and row["seeds_needed"] == seeds_needed(0.2, 0.1, 0.1) == 5
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(summary))
    assert main([str(path)]) == 0
    assert "| threads1 | opefo | 0.800 ± 0.100 (5) | 0.600 ± 0.100 | 5 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([str(path), "--figure", "pass@1"])
    assert "has no pass@1 of GRPO" in capsys.readouterr().err
