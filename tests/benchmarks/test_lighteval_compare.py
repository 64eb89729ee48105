"""benchmarks/lighteval_compare.py: an opefo-eval store and lighteval's details are compared problem by problem
(prompt token ids under lighteval's left padding, completions, scores, and this package's verifier on lighteval's
text), as the README's figures were counted."""

import importlib.util
import json
import os

from opefo_trl.eval import GeneratedSample, evaluate

# Problems of different prompt lengths (lighteval left-pads the shorter ones), what the two tools "generated" and how
# lighteval scored it.
QUESTIONS = ["What is 0 + 1?", "What is 1 + 2, added up?", "What is 2 + 3? Give the sum as a number.", "What is 3 + 4?"]
GOLDS = ["1", "3", "5", "7"]
OPEFO_TEXTS = ["Answer: 1", "So 1 + 2 is 3.", "Answer: 5", "The answer is 6."]
LIGHTEVAL_TEXTS = ["Answer: 1", "So 1 + 2 is 3.", "Answer: 5", "Answer: 7"]  # problem 3 generated otherwise
LIGHTEVAL_SCORES = [1.0, 1.0, 1.0, 1.0]  # lighteval pays problem 1's stray 3 (no answer form)


def _load():
    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "lighteval_compare.py")
    spec = importlib.util.spec_from_file_location("lighteval_compare", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Canned:
    def run(self, jobs):
        yield list(jobs), [GeneratedSample(OPEFO_TEXTS[job.problem_id], 5, "stop") for job in jobs]


def test_counts_agreement_per_problem(tiny_model_path, write_jsonl, tmp_path, eval_config, no_model_loading, capsys):
    from transformers import AutoTokenizer

    from opefo_trl.eval.benchmarks import Problem, build_prompt_ids

    bench = write_jsonl(
        tmp_path / "arith.jsonl", [{"problem": q, "answer": g} for q, g in zip(QUESTIONS, GOLDS, strict=True)]
    )
    opefo_dir = tmp_path / "opefo"
    evaluate(eval_config(tiny_model_path, bench, opefo_dir, num_samples=1), backend_factory=lambda *a: Canned())
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    problems = [Problem(i, q, g) for i, (q, g) in enumerate(zip(QUESTIONS, GOLDS, strict=True))]
    prompts = build_prompt_ids(tokenizer, problems, "qwen_math_boxed")
    width = max(map(len, prompts))
    assert min(map(len, prompts)) < width  # some prompts are padded
    details = tmp_path / "details.jsonl"
    with open(details, "w") as f:
        for i, prompt in enumerate(prompts):
            padded = [tokenizer.pad_token_id] * (width - len(prompt)) + prompt  # lighteval pads on the left
            scores = {"pass@k:k=1&n=1": LIGHTEVAL_SCORES[i]}
            record = {"problem_id": i, "prompt_ids": padded, "completion": LIGHTEVAL_TEXTS[i], "extracted": None}
            f.write(json.dumps({**record, "scores": scores}) + "\n")

    _load().main(tiny_model_path, str(opefo_dir), str(details))
    out = capsys.readouterr().out
    assert "prompts identical 4/4, completions identical 3/4, scores equal 2/4" in out
    # opefo-eval pays problems 0 and 2 (1 has no answer form, 3 is wrong); lighteval all four; this package's verifier
    # on lighteval's text 0, 2 and 3 (not 1's stray number).
    assert "pass@1: opefo-eval 0.500, lighteval 1.000, this package's verifier on lighteval's completions 0.750" in out
