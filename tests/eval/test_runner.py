"""opefo_trl.eval.evaluate end to end: outputs, metrics, resuming, per-sample seeds (tiny model, CPU, fp32)."""

import json
import os
import shutil

import numpy as np
import pytest
import torch

from opefo_trl.data.rewards import extract_answer, score_completion
from opefo_trl.eval import GeneratedSample, TransformersBackend, evaluate, resolve_model_source, sample_seed
from opefo_trl.eval.pass_at_k import pass_at_k

NUM_PROBLEMS = 4  # rows of the bench_file fixture: problem i asks i + (i + 1)


class CannedBackend:
    """Answers problem i correctly in its first i samples (c = min(i, n)), with a wrong answer otherwise."""

    def __init__(self, problems_by_id):
        self.problems = problems_by_id

    def run(self, jobs):
        samples = []
        for job in jobs:
            gold = self.problems[job.problem_id]
            text = f"Reasoning...\nAnswer: {gold}" if job.sample_index < job.problem_id else r"\boxed{-1}"
            samples.append(GeneratedSample(text, 5, "stop"))
        yield list(jobs), samples


def test_end_to_end_metrics_with_a_canned_backend(tiny_model_path, bench_file, tmp_path, eval_config, no_model_loading):
    golds = {i: str(2 * i + 1) for i in range(NUM_PROBLEMS)}
    config = eval_config(tiny_model_path, bench_file, tmp_path, num_samples=3, pass_at_k=[1, 3])
    results = evaluate(config, backend_factory=lambda source, cfg, tok: CannedBackend(golds))
    metrics = results["benchmarks"]["arith"]["metrics"]
    c = [min(i, 3) for i in range(NUM_PROBLEMS)]  # 0, 1, 2, 3 correct of 3
    assert [row["c"] for row in results["benchmarks"]["arith"]["problems"]] == c
    assert metrics["avg@n"] == pytest.approx(np.mean([ci / 3 for ci in c]))
    assert metrics["pass@3"] == pytest.approx(0.75)
    assert metrics["maj@n"] == pytest.approx(0.5)  # problems with c >= 2 of 3
    assert results["average"]["avg@n"] == pytest.approx(metrics["avg@n"])
    assert "| arith | 4 | 3 | 50.0 | 50.0 | 50.0 | 75.0 |" in results["markdown"]
    assert "| average |  |  | 50.0 | 50.0 | 50.0 | 75.0 |" in results["markdown"]


class RestatingBackend:
    """Restates problem i's question ('i + (i + 1)') as its answer in the first two samples; the third is only the
    right number (2i + 1)."""

    def run(self, jobs):
        texts = [
            f"The answer is {job.problem_id} + {job.problem_id + 1}."
            if job.sample_index < 2
            else str(2 * job.problem_id + 1)
            for job in jobs
        ]
        yield list(jobs), [GeneratedSample(text, 5, "stop") for text in texts]


def test_the_math_reward_mode_scores_the_stored_samples_without_drawing_them_again(
    tiny_model_path, bench_file, tmp_path, eval_config, no_model_loading
):
    def draw_nothing(*args):
        raise AssertionError("samples were drawn again")

    config = eval_config(tiny_model_path, bench_file, tmp_path)
    equivalent = evaluate(config, backend_factory=lambda *a: RestatingBackend())
    rows = equivalent["benchmarks"]["arith"]["problems"]
    assert [row["c"] for row in rows] == [2] * NUM_PROBLEMS
    assert rows[1]["statuses"] == ["correct", "correct", "no_answer"]
    config = eval_config(tiny_model_path, bench_file, tmp_path, math_reward_mode="strict")
    strict = evaluate(config, backend_factory=draw_nothing)
    rows = strict["benchmarks"]["arith"]["problems"]
    assert [row["c"] for row in rows] == [1] * NUM_PROBLEMS
    assert rows[1]["statuses"] == ["not_final", "not_final", "correct"] and rows[1]["answers"] == [None, None, "3"]
    assert strict["config"]["math_reward_mode"] == "strict" and equivalent["config"]["math_reward_mode"] == "equivalent"


@pytest.fixture(scope="module")
def full_run(tiny_model_path, bench_file, tmp_path_factory, eval_config):
    out = tmp_path_factory.mktemp("full")
    results = evaluate(eval_config(tiny_model_path, bench_file, out))
    return out, results


def test_end_to_end_outputs_have_the_right_shape(full_run, read_samples):
    out, results = full_run
    samples, records = read_samples(out)
    assert len(records) == len(samples) == NUM_PROBLEMS * 3
    assert set(samples) == {("arith", p, i) for p in range(NUM_PROBLEMS) for i in range(3)}
    assert all(r["finish_reason"] in ("stop", "length") and 1 <= r["num_tokens"] <= 6 for r in records)
    assert [r["seed"] for r in records] == [
        sample_seed(0, "arith", r["problem_id"], r["sample_index"]) for r in records
    ]

    with open(out / "results.json") as f:
        saved = json.load(f)
    assert saved["benchmarks"].keys() == {"arith"}
    rows = saved["benchmarks"]["arith"]["problems"]
    assert [row["problem_id"] for row in rows] == list(range(NUM_PROBLEMS))
    assert all(row["n"] == 3 and len(row["answers"]) == len(row["scores"]) == 3 for row in rows)
    assert set(saved["benchmarks"]["arith"]["metrics"]) >= {"avg@n", "maj@n", "pass@1", "pass@2", "n"}
    markdown = (out / "results.md").read_text()
    assert markdown.startswith("| benchmark | problems | n | avg@n | maj@n | pass@1 | pass@2 |")
    assert "| arith | 4 | 3 |" in markdown and "| average |" in markdown


def test_metrics_recomputed_from_stored_samples_match(full_run, read_samples):
    out, results = full_run
    samples, _ = read_samples(out)
    golds = [str(2 * i + 1) for i in range(NUM_PROBLEMS)]
    counts = [sum(score_completion(samples[("arith", p, i)], golds[p]) == 1.0 for i in range(3)) for p in range(4)]
    metrics = results["benchmarks"]["arith"]["metrics"]
    assert metrics["avg@n"] == pytest.approx(np.mean([c / 3 for c in counts]))
    assert metrics["pass@2"] == pytest.approx(np.mean([pass_at_k(3, c, 2) for c in counts]))
    answers = [row["answers"] for row in results["benchmarks"]["arith"]["problems"]]
    assert answers == [[extract_answer(samples[("arith", p, i)]) for i in range(3)] for p in range(4)]


def test_complete_rerun_does_not_load_the_model(full_run, tiny_model_path, bench_file, eval_config, no_model_loading):
    out, results = full_run
    again = evaluate(eval_config(tiny_model_path, bench_file, out))
    assert again["benchmarks"] == results["benchmarks"]


def test_interrupted_run_resumes_with_the_same_seeds_and_samples(
    full_run, tiny_model_path, bench_file, tmp_path, eval_config, read_samples, monkeypatch
):
    out_full, results_full = full_run
    expected, expected_records = read_samples(out_full)
    real_generate = TransformersBackend.generate
    calls = []

    def crash_on_second_batch(self, jobs):
        calls.append([(job.problem_id, job.sample_index) for job in jobs])
        if len(calls) == 2:
            raise KeyboardInterrupt  # as if the process were killed after the first batch was written
        return real_generate(self, jobs)

    monkeypatch.setattr(TransformersBackend, "generate", crash_on_second_batch)
    with pytest.raises(KeyboardInterrupt):
        evaluate(eval_config(tiny_model_path, bench_file, tmp_path))
    partial, _ = read_samples(tmp_path)
    # batch_size=4 with 3 samples per problem: problem 1 was cut after its first sample.
    assert sorted(partial) == [("arith", 0, 0), ("arith", 0, 1), ("arith", 0, 2), ("arith", 1, 0)]
    with open(tmp_path / "samples.jsonl", "a") as f:
        f.write('{"benchmark": "arith", "problem_')  # a write cut short by the kill

    calls.clear()

    def count_batches(self, jobs):
        calls.append([(job.problem_id, job.sample_index) for job in jobs])
        return real_generate(self, jobs)

    monkeypatch.setattr(TransformersBackend, "generate", count_batches)
    resumed = evaluate(eval_config(tiny_model_path, bench_file, tmp_path))
    samples, records = read_samples(tmp_path)
    # Only the 8 missing samples were drawn, none twice: problem 1 from its second sample on.
    assert [pair for batch in calls for pair in batch] == [(1, 1), (1, 2)] + [(p, i) for p in (2, 3) for i in range(3)]
    assert len(records) == NUM_PROBLEMS * 3
    seeds = {(r["problem_id"], r["sample_index"]): r["seed"] for r in records}
    assert seeds == {(r["problem_id"], r["sample_index"]): r["seed"] for r in expected_records}
    assert samples == expected  # fp32 on CPU: the same tokens despite other batch compositions
    assert resumed["benchmarks"] == results_full["benchmarks"]


def test_run_limited_to_some_problems_then_completed_matches(
    full_run, tiny_model_path, bench_file, tmp_path, eval_config, read_samples
):
    out_full, results_full = full_run
    expected, _ = read_samples(out_full)
    # 2 problems x 3 samples = 6 jobs: batches of 4 + 2, so the completion's batches are composed differently.
    evaluate(eval_config(tiny_model_path, bench_file, tmp_path, max_problems=2))
    completed = evaluate(eval_config(tiny_model_path, bench_file, tmp_path))
    samples, _ = read_samples(tmp_path)
    assert samples == expected
    assert completed["benchmarks"] == results_full["benchmarks"]


def test_fewer_samples_reuse_the_stored_ones(
    full_run, tiny_model_path, bench_file, eval_config, read_samples, no_model_loading
):
    out, _ = full_run
    samples, _ = read_samples(out)
    results = evaluate(eval_config(tiny_model_path, bench_file, out, num_samples=2))
    rows = results["benchmarks"]["arith"]["problems"]
    assert all(row["n"] == 2 for row in rows)
    assert [row["answers"] for row in rows] == [
        [extract_answer(samples[("arith", p, i)]) for i in range(2)] for p in range(NUM_PROBLEMS)
    ]


def test_resuming_with_other_settings_is_refused(full_run, tiny_model_path, bench_file, eval_config, no_model_loading):
    out, _ = full_run
    with pytest.raises(ValueError, match=r"other settings \(temperature: 1.0 -> 0.5\).*overwrite"):
        evaluate(eval_config(tiny_model_path, bench_file, out, temperature=0.5))


def test_lora_adapter_is_detected_and_applied(tiny_model_path, bench_file, tmp_path, eval_config, read_samples):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    lora = LoraConfig(r=4, lora_alpha=64, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    adapter_dir = tmp_path / "adapter"
    get_peft_model(model, lora).save_pretrained(adapter_dir)
    source = resolve_model_source(str(adapter_dir))
    assert source.adapter_path == str(adapter_dir) and source.model_path == tiny_model_path

    options = dict(max_problems=2, num_samples=2)
    base = evaluate(eval_config(tiny_model_path, bench_file, tmp_path / "base", **options))
    adapted = evaluate(eval_config(str(adapter_dir), bench_file, tmp_path / "adapted", **options))
    base_samples, _ = read_samples(tmp_path / "base")
    adapted_samples, _ = read_samples(tmp_path / "adapted")
    assert base_samples.keys() == adapted_samples.keys()
    assert base_samples != adapted_samples  # same seeds, different weights
    assert adapted["config"]["model_name_or_path"] == str(adapter_dir)
    assert base["benchmarks"]["arith"]["metrics"]["n"] == 2


def test_custom_columns_of_a_local_file(tiny_model_path, tmp_path, eval_config, write_jsonl):
    bench = write_jsonl(tmp_path / "qa.jsonl", [{"question": "1+1?", "solution": "2"}])
    config = eval_config(
        tiny_model_path,
        bench,
        tmp_path / "out",
        question_column="question",
        answer_column="solution",
        num_samples=1,
        max_new_tokens=2,
    )
    results = evaluate(config)
    (row,) = results["benchmarks"]["qa"]["problems"]
    assert (row["question"], row["gold"], row["n"]) == ("1+1?", "2", 1)


def _training_step(model_dir, names=None, step=1e-4):
    """Change the weights in place as an optimizer step does (every element of the chosen tensors moves by +-step)."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    for name in names or tensors:
        signs = torch.randint(0, 2, tensors[name].shape, generator=torch.Generator().manual_seed(0)) * 2 - 1
        tensors[name] = tensors[name] + step * signs
    save_file(tensors, path, metadata={"format": "pt"})


def test_samples_of_other_weights_are_refused_and_the_same_weights_reuse_them(
    tiny_model_path, bench_file, tmp_path, eval_config, snapshot
):
    """Training more into the model's directory changes its weights: the stored samples are refused with the fix.
    The same weights written again (a new mtime) keep them."""
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(tiny_model_path, model)
    out = tmp_path / "eval"
    golds = {i: str(2 * i + 1) for i in range(NUM_PROBLEMS)}
    canned = lambda source, cfg, tok: CannedBackend(golds)  # noqa: E731
    first = evaluate(eval_config(str(model), bench_file, out), backend_factory=canned)

    def refuse_loading(*args):
        raise AssertionError("the stored samples should have been reused")

    path = str(model / "model.safetensors")
    save_file(load_file(path), path, metadata={"format": "pt"})  # the same weights, rewritten
    assert evaluate(eval_config(str(model), bench_file, out), backend_factory=refuse_loading) == first

    before = snapshot(out)
    smallest = min(load_file(path).items(), key=lambda item: item[1].numel())[0]
    for trained in ([smallest], None):  # one tensor trained (e.g. a norm), or all of them
        _training_step(model, trained)
        with pytest.raises(ValueError) as error:
            evaluate(eval_config(str(model), bench_file, out), backend_factory=refuse_loading)
        assert str(error.value) == (
            f"{out} holds 12 samples drawn from other weights: model/model.safetensors changed since (e.g. training "
            f"wrote into {model}). Use another output_dir, or overwrite=True (--overwrite true) to discard them and "
            "sample the current weights."
        )
        assert snapshot(out) == before
    # The named fix: discard and resample.
    assert evaluate(eval_config(str(model), bench_file, out, overwrite=True), backend_factory=canned)


def test_samples_of_another_adapter_are_refused(tiny_model_path, bench_file, tmp_path, eval_config, snapshot):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    def save_adapter(seed):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
        lora = LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False)
        get_peft_model(model, lora).save_pretrained(tmp_path / "adapter")

    save_adapter(0)
    out = tmp_path / "eval"
    golds = {i: str(2 * i + 1) for i in range(NUM_PROBLEMS)}
    evaluate(
        eval_config(str(tmp_path / "adapter"), bench_file, out), backend_factory=lambda s, c, t: CannedBackend(golds)
    )
    before = snapshot(out)
    save_adapter(1)  # trained further: same files, other values
    with pytest.raises(ValueError, match="drawn from other weights: adapter/adapter_model.safetensors changed since"):
        evaluate(eval_config(str(tmp_path / "adapter"), bench_file, out))
    assert snapshot(out) == before


@pytest.mark.parametrize(
    "name, edit",
    [
        ("chat_template.jinja", lambda text: text.replace("<|im_start|>", "<|im_start|> ", 1)),
        ("generation_config.json", lambda text: json.dumps({**json.loads(text), "eos_token_id": 0})),
        ("tokenizer_config.json", lambda text: json.dumps({**json.loads(text), "model_max_length": 7})),
    ],
)
def test_samples_drawn_with_other_model_files_are_refused(
    name, edit, tiny_model_path, bench_file, tmp_path, eval_config, snapshot
):
    """The fingerprint covers the tokenizer files, chat template and generation config, not only the weights."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_path, model)
    out = tmp_path / "eval"
    golds = {i: str(2 * i + 1) for i in range(NUM_PROBLEMS)}
    evaluate(eval_config(str(model), bench_file, out), backend_factory=lambda source, cfg, tok: CannedBackend(golds))
    before = snapshot(out)
    path = model / name
    path.write_text(edit(path.read_text()))
    with pytest.raises(ValueError) as error:
        evaluate(eval_config(str(model), bench_file, out), backend_factory=lambda *args: None)
    assert str(error.value) == (
        f"{out} holds 12 samples drawn from other model files: model/{name} changed since (e.g. the chat template or "
        f"generation config of {model} was edited). Use another output_dir, or overwrite=True (--overwrite true) to "
        "discard them and sample the current model files."
    )
    assert snapshot(out) == before


def test_a_model_folder_without_weights_is_named(tiny_model_path, bench_file, tmp_path, eval_config, no_model_loading):
    """A folder with config.json but no weights is named, not a traceback from loading it."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_path, model)
    os.remove(model / "model.safetensors")
    with pytest.raises(FileNotFoundError) as error:
        evaluate(eval_config(str(model), bench_file, tmp_path / "eval"))
    assert str(error.value) == (
        f"{model} holds no weights (no *.safetensors, pytorch_model*.bin or shard index): it is not a whole saved "
        "model. Give a folder with its weights, e.g. a run's output_dir once training has finished, or one of its "
        "checkpoint-<step> folders."
    )
    assert not (tmp_path / "eval").exists()
