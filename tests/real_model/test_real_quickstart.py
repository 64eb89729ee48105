"""The quickstart notebook's real path (not its smoke path) on SmolLM2-135M-Instruct, shortened: the hub model and
GSM8K replaced through the notebook's parameters cell (papermill-style, a cell inserted after it) by the local model
folder and local GSM8K-format files; LoRA, the math reward, both training runs, the plot and the evaluation run as
on Colab, offline on the CPU."""

import json
import math

import pytest
from notebook_runner import REPO_ROOT, execute_notebook, write_kernelspec

pytestmark = pytest.mark.real_model

NOTEBOOK = REPO_ROOT / "notebooks" / "quickstart.ipynb"
TRAIN_FILE = REPO_ROOT / "recipes" / "smollm2-135m-instruct" / "word_problems.jsonl"
MAX_STEPS, EVAL_PROBLEMS = 2, 2
PROBE = """{
    "smoke": SMOKE,
    "model_id": MODEL_ID,
    "train_problems": len(train_dataset),
    "histories": histories,
    "plotted": plot_result.plotted,
    "adapters": {m: json.load(open(os.path.join(OUTPUT_ROOT, m, "adapter_config.json"))) for m in ("opefo", "grpo")},
    "eval": {name: len(next(iter(r["benchmarks"].values()))["problems"]) for name, r in eval_results.items()},
}"""


def logged(history, key):
    return [row[key] for row in history if key in row and "step" in row]


def test_quickstart_real_path_on_the_local_real_model(real_model_path, tmp_path, monkeypatch):
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text(
        "".join(
            json.dumps({"question": f"What is {a} + {a + 1}?", "answer": f"#### {2 * a + 1}"}) + "\n" for a in (2, 3)
        )
    )
    parameters = (
        f"MODEL_ID = {real_model_path!r}\n"
        f"DATA_FILES = {{'train': {str(TRAIN_FILE)!r}, 'test': {str(heldout)!r}}}\n"
        f"MAX_STEPS, PROMPTS_PER_STEP, NUM_GENERATIONS, MAX_COMPLETION_LENGTH = {MAX_STEPS}, 2, 4, 24\n"
        f"TEMPERATURE, EVAL_PROBLEMS, EVAL_SAMPLES = 0.7, {EVAL_PROBLEMS}, 2\n"
    )
    monkeypatch.delenv("OPEFO_SMOKE", raising=False)
    kernels = write_kernelspec(tmp_path / "kernels_root")
    result = execute_notebook(NOTEBOOK, kernels, tmp_path, monkeypatch, PROBE, parameters=parameters)

    assert result["smoke"] is False and result["model_id"] == real_model_path
    assert result["train_problems"] == MAX_STEPS * 2
    for method, history in result["histories"].items():
        for key in ("loss", "entropy", "reward", "entropy_flow/lambda"):
            values = logged(history, key)
            assert len(values) == MAX_STEPS and all(math.isfinite(v) for v in values), (method, key, values)
        assert all(-1 <= v <= 1 for v in logged(history, "entropy_flow/lambda"))
        assert all(0 <= v <= 1 for v in logged(history, "reward"))
    assert set(result["histories"]) == {"opefo", "grpo"}
    # The LoRA adapters were trained on the local folder, not on the hub model.
    for adapter in result["adapters"].values():
        assert adapter["base_model_name_or_path"] == real_model_path and adapter["r"] == 16
    assert {"entropy", "reward", "entropy_flow/lambda"} <= set(result["plotted"])
    assert result["eval"] == {"base": EVAL_PROBLEMS, "grpo": EVAL_PROBLEMS, "opefo": EVAL_PROBLEMS}
    print(
        {
            m: {k: logged(h, k) for k in ("reward", "entropy", "entropy_flow/lambda")}
            for m, h in result["histories"].items()
        }
    )
