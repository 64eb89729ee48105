"""The notebooks under notebooks/ run end to end in smoke mode and compute what their text claims.

Every notebook is executed with nbclient in a fresh kernel that runs this interpreter (a kernelspec written to a
temporary folder, so no Jupyter installation or user kernelspec is involved) with ``OPEFO_SMOKE=1`` and
``HF_HUB_OFFLINE=1``: tiny local model, no network, CPU. Any cell error fails the test. After the notebook's own
cells, a probe cell prints a JSON summary of the variables the notebook computed, and the test checks it:

- ``entropy_flow_explained``: the first-order prediction matches the exact entropy change; the cheap estimates share
  a sign; lambda* = (N - P) / (N + P) and the reweighted net flow is ~0; the toy GRPO run collapses while the toy
  OPEFO run (``full`` estimate) keeps its entropy, as the notebook's conclusions say.
- ``quickstart``: both runs trained and logged ``entropy_flow/lambda`` every step, the OPEFO run balanced its flow,
  the comparison plot was written, and the base model and both adapters were evaluated.

Notebooks are stored with outputs cleared and a ``parameters`` cell reading ``OPEFO_SMOKE`` (Colab / papermill).
Takes ~1 min on 2 CPU cores (most of it TRL imports and the two tiny training runs).
"""

import math
import os
import sys
from pathlib import Path

import nbformat
import pytest
from notebook_runner import REPO_ROOT, execute_notebook, write_kernelspec

pytestmark = pytest.mark.slow

NOTEBOOK_DIR = REPO_ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))

# Per notebook: a Python expression evaluated in the kernel after the last cell (it must be JSON-serialisable).
PROBES = {
    "entropy_flow_explained": """{
        "python": sys.executable,
        "first_order_max_rel_err": first_order_max_rel_err,
        "cheap_estimates_share_sign": cheap_estimates_share_sign,
        "agreement_with_full": [row[3] for row in rows],
        "lambda": float(lam),
        "P": float(before.increase), "N": float(before.decrease),
        "weighted_P": float(after.increase), "weighted_N": float(after.decrease),
        "weighted_net_relative": weighted_net_relative,
        "method_matches_functions": method_matches_functions,
        "exact_changes": exact_changes,
        "toy_steps": TOY_STEPS,
        "toy": toy_runs,
    }""",
    "quickstart": """{
        "python": sys.executable,
        "max_steps": MAX_STEPS,
        "eval_problems": EVAL_PROBLEMS,
        "histories": histories,
        "plot_path": os.path.abspath(plot_result.path),
        "plotted": plot_result.plotted,
        "adapters": {m: os.path.isfile(os.path.join(OUTPUT_ROOT, m, "adapter_config.json")) for m in ("opefo", "grpo")},
        "eval": {
            name: {"average": r["average"], "num_problems": len(next(iter(r["benchmarks"].values()))["problems"])}
            for name, r in eval_results.items()
        },
    }""",
}


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory):
    """A kernelspec for this interpreter, so the notebooks run in the same environment as the tests."""
    return write_kernelspec(tmp_path_factory.mktemp("kernels"))


def execute_smoke(path: Path, kernel_dir: Path, workdir: Path, monkeypatch) -> dict:
    """Run ``path`` in smoke mode in ``workdir``; return the probe's JSON (or {} when the notebook has no probe)."""
    monkeypatch.setenv("OPEFO_SMOKE", "1")
    return execute_notebook(path, kernel_dir, workdir, monkeypatch, PROBES.get(path.stem))


def logged(history: list[dict], key: str) -> list[float]:
    return [row[key] for row in history if key in row and "step" in row]


def check_entropy_flow_explained(result: dict) -> None:
    # Section 2: the `full` estimate is the exact first-order change (relative error ~ eta at eta = 1e-4).
    assert result["first_order_max_rel_err"] < 1e-3
    # Section 3: opefo / onaction / sign share a sign; `full` disagrees on some tokens but agrees on most.
    assert result["cheap_estimates_share_sign"] is True
    agreement = result["agreement_with_full"]
    assert all(0.5 < a <= 1.0 for a in agreement) and min(agreement) < 1.0
    # Section 4: lambda* from P and N, and the reweighted net flow vanishes.
    P, N, lam = result["P"], result["N"], result["lambda"]
    assert P > 0 and N > 0
    assert lam == pytest.approx((N - P) / (N + P), rel=1e-5)
    assert result["weighted_P"] == pytest.approx((1 + lam) * P, rel=1e-5)
    assert result["weighted_N"] == pytest.approx((1 - lam) * N, rel=1e-5)
    assert result["weighted_P"] == pytest.approx(result["weighted_N"], rel=1e-5)
    assert result["weighted_net_relative"] < 1e-5
    assert result["method_matches_functions"] is True
    # With `full`-estimate weights the exact entropy change of the batch's step all but vanishes.
    exact = result["exact_changes"]
    assert abs(exact["OPEFO weights, full estimate"]) < 0.01 * abs(exact["unweighted"])
    # Section 5: what the conclusions claim about the toy.
    toy = result["toy"]
    assert {len(run["entropy"]) for run in toy.values()} == {result["toy_steps"]}
    grpo, opefo_full, opefo_cheap = toy["GRPO (w = 1)"], toy["OPEFO, full estimate"], toy["OPEFO, opefo estimate"]
    assert grpo["entropy"][-1] < grpo["entropy"][0] - 0.5  # plain PG collapses
    assert abs(opefo_full["entropy"][-1] - opefo_full["entropy"][0]) < 0.02  # OPEFO (exact flow) holds the entropy
    for opefo_run in (opefo_full, opefo_cheap):
        assert opefo_run["coverage"][-1] > grpo["coverage"][-1]  # and keeps more correct answers alive
        assert opefo_run["reward"][-1] < grpo["reward"][-1]  # at the price of slower reward growth
    assert all(0.0 <= lam <= 1.0 for lam in opefo_full["lambda"])  # decrease-dominated toy: lambda* >= 0


def check_quickstart(result: dict, workdir: Path) -> None:
    histories = result["histories"]
    assert set(histories) == {"opefo", "grpo"}
    for method, history in histories.items():
        lambdas = logged(history, "entropy_flow/lambda")
        assert len(lambdas) == result["max_steps"], f"{method}: entropy_flow/lambda not logged every step"
        assert all(math.isfinite(x) and -1.0 <= x <= 1.0 for x in lambdas)
        increase, decrease = logged(history, "entropy_flow/increase"), logged(history, "entropy_flow/decrease")
        for lam, inc, dec in zip(lambdas, increase, decrease, strict=True):
            assert lam == pytest.approx((dec - inc) / (inc + dec) if inc + dec > 0 else 0.0, abs=1e-6)
        assert len(logged(history, "entropy")) == result["max_steps"]
        assert len(logged(history, "reward")) == result["max_steps"]
    opefo, grpo = histories["opefo"], histories["grpo"]
    # Same seed and data: the first rollout batch (before any update) is identical in both runs. OPEFO reads log pi
    # and H from generation's logits, GRPO's diagnostics from the training forward: float32 rounding of two forwards
    # (~1e-6 in log pi) moves lambda* by ~1e-6.
    assert logged(opefo, "entropy_flow/lambda")[0] == pytest.approx(logged(grpo, "entropy_flow/lambda")[0], abs=1e-5)
    # OPEFO applied lambda* and balanced the flow of every batch; the GRPO run only logged the diagnostics.
    assert any(lam != 0.0 for lam in logged(opefo, "entropy_flow/lambda"))
    assert not logged(opefo, "opefo/lambda_applied")  # the lambda applied is lambda*, logged once above
    for net, inc, dec in zip(
        logged(opefo, "opefo/weighted_net"),
        logged(opefo, "entropy_flow/increase"),
        logged(opefo, "entropy_flow/decrease"),
        strict=True,
    ):
        assert abs(net) <= 1e-4 * (inc + dec) + 1e-12
    assert not logged(grpo, "opefo/weighted_net")
    assert result["adapters"] == {"opefo": True, "grpo": True}
    # The comparison plot.
    plot = Path(result["plot_path"]).resolve()
    assert plot.is_relative_to(workdir.resolve()) and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {"entropy", "reward", "entropy_flow/lambda"} <= set(result["plotted"])
    # Evaluation of the base model and both adapters.
    assert set(result["eval"]) == {"base", "grpo", "opefo"}
    for evaluation in result["eval"].values():
        assert evaluation["num_problems"] == result["eval_problems"]
        assert 0.0 <= evaluation["average"]["avg@n"] <= 1.0


def test_every_notebook_has_checks():
    assert NOTEBOOKS, f"no notebooks found in {NOTEBOOK_DIR}"
    assert {p.stem for p in NOTEBOOKS} == set(PROBES), "add a probe and a check for every notebook in notebooks/"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_stored_clean_with_a_smoke_parameter(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    dirty = [i for i, c in enumerate(code_cells) if c.outputs or c.execution_count is not None]
    assert not dirty, f"{path.name}: clear the outputs of code cells {dirty} before committing"
    parameter_cells = [c for c in code_cells if "parameters" in c.metadata.get("tags", [])]
    assert len(parameter_cells) == 1, f"{path.name}: needs exactly one cell tagged 'parameters'"
    assert 'SMOKE = os.environ.get("OPEFO_SMOKE", "0") == "1"' in parameter_cells[0].source
    assert code_cells.index(parameter_cells[0]) == 0, f"{path.name}: the parameters cell must be the first code cell"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_in_smoke_mode(path, kernel_dir, tmp_path, monkeypatch):
    result = execute_smoke(path, kernel_dir, tmp_path, monkeypatch)
    assert os.path.realpath(result["python"]) == os.path.realpath(sys.executable)
    if path.stem == "entropy_flow_explained":
        check_entropy_flow_explained(result)
    elif path.stem == "quickstart":
        check_quickstart(result, tmp_path)
