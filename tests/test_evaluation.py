"""opefo-eval: registry, loading, backends, scoring, resumability and input errors (offline, tiny model, CPU)."""

import json
import os

import numpy as np
import pytest

from opefo_trl import evaluation
from opefo_trl.evaluation import (
    BENCHMARKS,
    EvaluationConfig,
    GeneratedSample,
    Problem,
    SampleJob,
    TransformersBackend,
    build_vllm_requests,
    compute_benchmark_metrics,
    evaluate,
    load_problems,
    resolve_benchmarks,
    resolve_model_source,
    score_problem,
    select_backend,
)
from opefo_trl.pass_at_k import pass_at_k
from opefo_trl.rewards import extract_answer, score_completion

NUM_PROBLEMS = 4


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def bench_file(tmp_path_factory):
    rows = [{"problem": f"What is {i} + {i + 1}?", "answer": str(2 * i + 1)} for i in range(NUM_PROBLEMS)]
    return _write_jsonl(tmp_path_factory.mktemp("bench") / "arith.jsonl", rows)


def _config(model, bench, out, **overrides):
    settings = dict(
        model_name_or_path=model,
        benchmarks=[bench],
        num_samples=3,
        max_new_tokens=6,
        batch_size=4,
        output_dir=str(out),
        backend="transformers",
        progress=False,
    )
    settings.update(overrides)
    return EvaluationConfig(**settings)


def _read_samples(out):
    with open(os.path.join(out, "samples.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return {(r["benchmark"], r["problem_id"], r["sample_index"]): r["completion"] for r in records}, records


@pytest.fixture
def no_model_loading(monkeypatch):
    """Fail the test if the model would be loaded."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(TransformersBackend, "load", refuse)


# ---------------------------------------------------------------------------------------------------------------------
# Registry and loading
# ---------------------------------------------------------------------------------------------------------------------


def test_registry_matches_the_papers_benchmarks():
    expected = {
        "aime24": ("HuggingFaceH4/aime_2024", "train", "problem", "answer", 32),
        "aime25": ("math-ai/aime25", "test", "problem", "answer", 32),
        "amc23": ("math-ai/amc23", "test", "question", "answer", 32),
        "math500": ("HuggingFaceH4/MATH-500", "test", "problem", "answer", 1),
        "minerva": ("math-ai/minervamath", "test", "question", "answer", 1),
        "olympiadbench": ("math-ai/olympiadbench", "test", "question", "final_answer", 1),
    }
    got = {
        name: (s.dataset_id, s.split, s.question_column, s.answer_column, s.num_samples)
        for name, s in BENCHMARKS.items()
    }
    assert got == expected


def test_hub_benchmark_is_loaded_with_its_hub_id_and_split(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        return datasets.Dataset.from_list([{"problem": "1+1?", "answer": "2"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    (aime,) = resolve_benchmarks(EvaluationConfig(model_name_or_path="m", benchmarks=["aime24"]))
    assert [p.gold for p in load_problems(aime)] == ["2"]
    assert calls == [(("HuggingFaceH4/aime_2024", None), {"split": "train"})]


def test_hub_load_failure_explains_offline_workaround(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    (bench,) = resolve_benchmarks(EvaluationConfig(model_name_or_path="m", benchmarks=["math500"]))
    with pytest.raises(RuntimeError, match=r"math500.*HuggingFaceH4/MATH-500.*benchmark_files=math500=PATH"):
        load_problems(bench)


def test_local_stand_ins_of_hub_formats(tmp_path):
    import datasets

    # OlympiadBench: `question` + `final_answer` as a list; AMC23: `question` + numeric `answer`.
    olympiad = tmp_path / "olympiad.parquet"
    datasets.Dataset.from_list(
        [
            {"question": "Find x and y.", "final_answer": ["$1$", "$2$"]},
            {"question": "Half?", "final_answer": ["$\\frac{1}{2}$"]},
        ]
    ).to_parquet(str(olympiad))
    amc = _write_jsonl(tmp_path / "amc.jsonl", [{"question": "3 * 9?", "answer": 27.0}])
    config = EvaluationConfig(
        model_name_or_path="m",
        benchmarks=["olympiadbench", "amc23"],
        benchmark_files=[f"olympiadbench={olympiad}", f"amc23={amc}"],
    )
    olympiad_bench, amc_bench = resolve_benchmarks(config)
    assert (olympiad_bench.num_samples, amc_bench.num_samples) == (1, 32)
    problems = load_problems(olympiad_bench)
    assert [p.gold for p in problems] == [["$1$", "$2$"], ["$\\frac{1}{2}$"]]
    assert score_completion(r"\boxed{1, 2}", problems[0].gold) == 1.0
    assert score_completion("Answer: 0.5", problems[1].gold) == 1.0
    (amc_problem,) = load_problems(amc_bench)
    assert score_completion(r"\boxed{27}", amc_problem.gold) == 1.0


def test_max_problems_takes_the_first_rows(bench_file):
    (bench,) = resolve_benchmarks(EvaluationConfig(model_name_or_path="m", benchmarks=[bench_file]))
    assert [p.problem_id for p in load_problems(bench, max_problems=2)] == [0, 1]
    assert bench.name == "arith" and bench.k_values == (1,)


# ---------------------------------------------------------------------------------------------------------------------
# Scoring and metrics on hand-written samples
# ---------------------------------------------------------------------------------------------------------------------


def test_score_problem_and_metrics_from_hand_written_samples():
    rows = [
        score_problem(Problem(0, "q0", "42"), [r"\boxed{42}", "Answer: 42", "Answer: 41", "nothing"]),  # c = 2
        score_problem(Problem(1, "q1", r"\frac{1}{2}"), ["Answer: 0.3", "Answer: 0.3", r"\boxed{1/2}", "x"]),  # c = 1
        score_problem(Problem(2, "q2", "7"), ["Answer: 6"] * 4),  # c = 0
        score_problem(Problem(3, "q3", r"\frac{"), [r"\boxed{1}"] * 4),  # unparseable gold
    ]
    assert [row["c"] for row in rows] == [2, 1, 0, None]
    assert rows[0]["answers"] == ["42", "42", "41", None]
    assert (rows[0]["majority_answer"], rows[0]["majority_correct"]) == ("42", True)
    assert (rows[1]["majority_answer"], rows[1]["majority_correct"]) == (extract_answer("Answer: 0.3"), False)
    assert rows[3]["scorable"] is False

    metrics = compute_benchmark_metrics(rows, [1, 2, 4])
    assert metrics["num_problems"] == 4 and metrics["num_unscorable_problems"] == 1 and metrics["n"] == 4
    assert metrics["avg@n"] == pytest.approx((2 / 4 + 1 / 4 + 0) / 3)
    assert metrics["maj@n"] == pytest.approx(1 / 3)
    for k in (1, 2, 4):
        expected = np.mean([pass_at_k(4, 2, k), pass_at_k(4, 1, k), pass_at_k(4, 0, k)])
        assert metrics[f"pass@{k}"] == pytest.approx(expected)
    assert metrics["pass@1"] == pytest.approx(metrics["avg@n"])
    with pytest.raises(ValueError, match="pass@8 needs at least 8"):
        compute_benchmark_metrics(rows, [8])


class CannedBackend:
    """Answers problem i correctly in its first i samples (c = min(i, n)), with a wrong answer otherwise."""

    def __init__(self, problems_by_id):
        self.problems = problems_by_id
        self.calls = 0

    def run(self, jobs):
        self.calls += 1
        samples = []
        for job in jobs:
            gold = self.problems[job.problem_id]
            text = f"Reasoning...\nAnswer: {gold}" if job.sample_index < job.problem_id else r"\boxed{-1}"
            samples.append(GeneratedSample(text, 5, "stop"))
        yield list(jobs), samples


def test_end_to_end_metrics_with_a_canned_backend(tiny_model_path, bench_file, tmp_path, no_model_loading):
    golds = {i: str(2 * i + 1) for i in range(NUM_PROBLEMS)}
    config = _config(tiny_model_path, bench_file, tmp_path, num_samples=3, pass_at_k=[1, 3])
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


# ---------------------------------------------------------------------------------------------------------------------
# Backends: choice, vLLM requests, seeded sampler
# ---------------------------------------------------------------------------------------------------------------------


def test_backend_choice():
    assert select_backend("auto", vllm_available=False, cuda_available=True) == "transformers"
    assert select_backend("auto", vllm_available=True, cuda_available=False) == "transformers"
    assert select_backend("auto", vllm_available=True, cuda_available=True) == "vllm"
    assert select_backend("transformers", vllm_available=True) == "transformers"
    with pytest.raises(ImportError, match=r"vLLM is not installed.*opefo-trl\[vllm\]"):
        select_backend("vllm", vllm_available=False)
    import importlib.util

    assert evaluation.vllm_is_available() is (importlib.util.find_spec("vllm") is not None)


def test_vllm_requests_one_per_problem_with_n_and_seed():
    config = EvaluationConfig(model_name_or_path="m", temperature=1.0, top_p=0.7, max_new_tokens=64, seed=3)
    jobs = [SampleJob("aime24", 0, i, "f0", (1, 2, 3)) for i in range(4)]
    jobs += [SampleJob("aime24", 5, i, "f5", (7, 8)) for i in range(2, 4)]  # a problem resumed from sample 2
    requests = build_vllm_requests(jobs, config)
    assert [prompt for prompt, _ in requests] == [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [7, 8]}]
    first, second = (sampling for _, sampling in requests)
    assert (first["n"], second["n"]) == (4, 2)
    for sampling in (first, second):
        assert sampling["temperature"] == 1.0 and sampling["top_p"] == 0.7 and sampling["max_tokens"] == 64
        assert sampling["repetition_penalty"] == 1.0 and sampling["top_k"] == 0
    assert first["seed"] != second["seed"]
    assert build_vllm_requests(jobs, config) == requests  # deterministic
    assert build_vllm_requests(jobs, EvaluationConfig(model_name_or_path="m", seed=4))[0][1]["seed"] != first["seed"]


def test_seeded_gumbel_sampler_draws_from_the_top_p_distribution():
    import torch
    from transformers import TemperatureLogitsWarper, TopPLogitsWarper

    sampler_cls = evaluation._make_seeded_gumbel_processor()
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0])
    rows = 20000
    scores = logits.repeat(rows, 1)
    temperature, top_p = 0.8, 0.9
    scores = TopPLogitsWarper(top_p)(None, TemperatureLogitsWarper(temperature)(None, scores))
    draws = sampler_cls(range(rows), "cpu")(None, scores).argmax(-1)
    frequencies = torch.bincount(draws, minlength=5).float() / rows

    probs = torch.softmax(logits / temperature, -1)
    order = torch.argsort(probs, descending=True)
    keep = torch.zeros(5, dtype=torch.bool)
    keep[order[: int((torch.cumsum(probs[order], 0) < top_p).sum()) + 1]] = True
    expected = torch.where(keep, probs, 0.0)
    expected /= expected.sum()
    assert frequencies[~keep].sum() == 0
    assert torch.allclose(frequencies, expected, atol=0.015)
    # One generator per row: a row's draw does not depend on the other rows.
    again = sampler_cls([7, 3], "cpu")(None, scores[:2]).argmax(-1)
    alone = sampler_cls([3], "cpu")(None, scores[:1]).argmax(-1)
    assert again[1] == alone[0]


# ---------------------------------------------------------------------------------------------------------------------
# End to end on the tiny model (transformers backend)
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def full_run(tiny_model_path, bench_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    results = evaluate(_config(tiny_model_path, bench_file, out))
    return out, results


def test_end_to_end_outputs_have_the_right_shape(full_run):
    out, results = full_run
    samples, records = _read_samples(out)
    assert len(records) == len(samples) == NUM_PROBLEMS * 3
    assert set(samples) == {("arith", p, i) for p in range(NUM_PROBLEMS) for i in range(3)}
    assert all(r["finish_reason"] in ("stop", "length") and 1 <= r["num_tokens"] <= 6 for r in records)

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


def test_metrics_recomputed_from_stored_samples_match(full_run, bench_file):
    out, results = full_run
    samples, _ = _read_samples(out)
    golds = [str(2 * i + 1) for i in range(NUM_PROBLEMS)]
    counts = [sum(score_completion(samples[("arith", p, i)], golds[p]) == 1.0 for i in range(3)) for p in range(4)]
    metrics = results["benchmarks"]["arith"]["metrics"]
    assert metrics["avg@n"] == pytest.approx(np.mean([c / 3 for c in counts]))
    assert metrics["pass@2"] == pytest.approx(np.mean([pass_at_k(3, c, 2) for c in counts]))
    answers = [[row_answer for row_answer in row["answers"]] for row in results["benchmarks"]["arith"]["problems"]]
    assert answers == [[extract_answer(samples[("arith", p, i)]) for i in range(3)] for p in range(4)]


def test_complete_rerun_does_not_load_the_model(full_run, tiny_model_path, bench_file, no_model_loading):
    out, results = full_run
    again = evaluate(_config(tiny_model_path, bench_file, out))
    assert again["benchmarks"] == results["benchmarks"]


def test_interrupted_run_resumes_to_the_uninterrupted_result(
    full_run, tiny_model_path, bench_file, tmp_path, monkeypatch
):
    out_full, results_full = full_run
    expected, _ = _read_samples(out_full)
    real_generate = TransformersBackend.generate
    calls = []

    def crash_on_second_batch(self, jobs, seeds):
        calls.append(len(jobs))
        if len(calls) == 2:
            raise KeyboardInterrupt  # as if the process were killed after the first batch was written
        return real_generate(self, jobs, seeds)

    monkeypatch.setattr(TransformersBackend, "generate", crash_on_second_batch)
    with pytest.raises(KeyboardInterrupt):
        evaluate(_config(tiny_model_path, bench_file, tmp_path))
    partial, _ = _read_samples(tmp_path)
    assert len(partial) == 4  # the first batch (batch_size=4) was flushed
    with open(tmp_path / "samples.jsonl", "a") as f:
        f.write('{"benchmark": "arith", "problem_')  # a write cut short by the kill

    monkeypatch.setattr(TransformersBackend, "generate", real_generate)
    resumed = evaluate(_config(tiny_model_path, bench_file, tmp_path))
    samples, records = _read_samples(tmp_path)
    assert len(records) == NUM_PROBLEMS * 3  # only the missing 8 samples were drawn, none twice
    assert samples == expected
    assert resumed["benchmarks"] == results_full["benchmarks"]


def test_run_limited_to_some_problems_then_completed_matches(full_run, tiny_model_path, bench_file, tmp_path):
    out_full, results_full = full_run
    expected, _ = _read_samples(out_full)
    # 2 problems x 3 samples = 6 jobs: batches of 4 + 2, so the completion's batches are composed differently.
    evaluate(_config(tiny_model_path, bench_file, tmp_path, max_problems=2))
    completed = evaluate(_config(tiny_model_path, bench_file, tmp_path))
    samples, _ = _read_samples(tmp_path)
    assert samples == expected
    assert completed["benchmarks"] == results_full["benchmarks"]


def test_fewer_samples_reuse_the_stored_ones(full_run, tiny_model_path, bench_file, no_model_loading):
    out, _ = full_run
    samples, _ = _read_samples(out)
    results = evaluate(_config(tiny_model_path, bench_file, out, num_samples=2))
    rows = results["benchmarks"]["arith"]["problems"]
    assert all(row["n"] == 2 for row in rows)
    assert [row["answers"] for row in rows] == [
        [extract_answer(samples[("arith", p, i)]) for i in range(2)] for p in range(NUM_PROBLEMS)
    ]


def test_context_length_warning():
    assert evaluation.context_length_warning([[1] * 10, [1] * 30], 994, 1024) is None
    assert "longest prompt (30 tokens) plus max_new_tokens=995" in evaluation.context_length_warning(
        [[1] * 10, [1] * 30], 995, 1024
    )


def test_resuming_with_other_settings_is_refused(full_run, tiny_model_path, bench_file, no_model_loading):
    out, _ = full_run
    with pytest.raises(ValueError, match=r"other settings \(temperature: 1.0 -> 0.5\).*overwrite"):
        evaluate(_config(tiny_model_path, bench_file, out, temperature=0.5))


def test_lora_adapter_is_detected_and_applied(tiny_model_path, bench_file, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    lora = LoraConfig(r=4, lora_alpha=64, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    adapter_dir = tmp_path / "adapter"
    get_peft_model(model, lora).save_pretrained(adapter_dir)
    source = resolve_model_source(str(adapter_dir))
    assert source.adapter_path == str(adapter_dir) and source.model_path == tiny_model_path

    base = evaluate(_config(tiny_model_path, bench_file, tmp_path / "base", max_problems=2, num_samples=2))
    adapted = evaluate(_config(str(adapter_dir), bench_file, tmp_path / "adapted", max_problems=2, num_samples=2))
    base_samples, _ = _read_samples(tmp_path / "base")
    adapted_samples, _ = _read_samples(tmp_path / "adapted")
    assert base_samples.keys() == adapted_samples.keys()
    assert base_samples != adapted_samples  # same seeds, different weights
    assert adapted["config"]["model_name_or_path"] == str(adapter_dir)
    assert base["benchmarks"]["arith"]["metrics"]["n"] == 2


# ---------------------------------------------------------------------------------------------------------------------
# Bad input: clear errors before the model is loaded
# ---------------------------------------------------------------------------------------------------------------------


def test_unknown_benchmark_lists_valid_names(tiny_model_path, tmp_path, no_model_loading):
    with pytest.raises(ValueError, match=r"Unknown benchmark 'aime2024'.*aime24, aime25, amc23, math500, minerva"):
        evaluate(_config(tiny_model_path, "aime2024", tmp_path))


def test_missing_column_lists_the_columns(tiny_model_path, tmp_path, no_model_loading):
    bench = _write_jsonl(tmp_path / "qa.jsonl", [{"question": "1+1?", "solution": "2"}])
    with pytest.raises(ValueError, match=r"no column 'problem'; its columns are \['question', 'solution'\]"):
        evaluate(_config(tiny_model_path, bench, tmp_path / "out"))


def test_custom_columns_of_a_local_file(tiny_model_path, tmp_path):
    bench = _write_jsonl(tmp_path / "qa.jsonl", [{"question": "1+1?", "solution": "2"}])
    config = _config(
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


def test_missing_model_path(bench_file, tmp_path, no_model_loading):
    with pytest.raises(FileNotFoundError, match="Model path '/nonexistent/model' does not exist"):
        evaluate(_config("/nonexistent/model", bench_file, tmp_path))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="neither a model"):
        evaluate(_config(str(empty), bench_file, tmp_path / "out"))
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/nonexistent/base"}))
    with pytest.raises(FileNotFoundError, match="base model '/nonexistent/base' of adapter"):
        evaluate(_config(str(adapter), bench_file, tmp_path / "out"))


def test_k_larger_than_n_is_refused_before_generation(tiny_model_path, bench_file, tmp_path, no_model_loading):
    with pytest.raises(ValueError, match=r"pass@8 was requested but benchmark 'arith' is sampled n=3 times"):
        evaluate(_config(tiny_model_path, bench_file, tmp_path, pass_at_k=[1, 8]))
    # The paper protocol: n=1 on MATH500, so pass@4 there is an error too.
    with pytest.raises(ValueError, match="'math500' is sampled n=1"):
        resolve_benchmarks(EvaluationConfig(model_name_or_path="m", benchmarks=["aime24", "math500"], pass_at_k=[4]))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(prompt_template="chatml"), "Unknown prompt template 'chatml'"),
        (dict(top_p=0.0), "top_p must be in"),
        (dict(num_samples=0), "num_samples must be at least 1"),
        (dict(backend="tgi"), "Unknown backend 'tgi'"),
        (dict(benchmark_files=["aime24:/x.parquet"]), "NAME=PATH"),
        (dict(model_name_or_path=None), "model_name_or_path is required"),
    ],
)
def test_invalid_options(overrides, message, bench_file, tmp_path):
    with pytest.raises(ValueError, match=message):
        _config("m", bench_file, tmp_path, **overrides)


# ---------------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------------


def test_cli_runs_and_reports_bad_input(tiny_model_path, bench_file, tmp_path, capsys):
    from opefo_trl.cli.evaluate import main

    args = [
        "--model_name_or_path",
        tiny_model_path,
        "--benchmarks",
        bench_file,
        "--num_samples",
        "2",
        "--max_new_tokens",
        "3",
        "--max_problems",
        "2",
        "--backend",
        "transformers",
        "--no_progress",
        "--output_dir",
        str(tmp_path),
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "| arith | 2 | 2 |" in out and (tmp_path / "results.md").exists()

    assert main(args[:3] + ["aime2024"] + args[4:]) == 2
    assert "opefo-eval: error: ValueError: Unknown benchmark 'aime2024'" in capsys.readouterr().err
    assert main(args + ["--pass_at_k", "4"]) == 2
    assert "pass@4 was requested" in capsys.readouterr().err
    assert main(args + ["--no_such_flag", "1"]) == 2
    assert "no_such_flag" in capsys.readouterr().err

    # The same options from a YAML recipe: same settings, so the finished run is reused, not resampled.
    recipe = tmp_path / "eval.yaml"
    recipe.write_text(
        f"model_name_or_path: {tiny_model_path}\nbenchmarks: [{bench_file}]\nnum_samples: 2\nmax_new_tokens: 3\n"
        f"max_problems: 2\nbackend: transformers\nprogress: false\noutput_dir: {tmp_path}\n"
    )
    written = (tmp_path / "samples.jsonl").read_text()
    assert main(["--config", str(recipe)]) == 0
    assert "| arith | 2 | 2 |" in capsys.readouterr().out
    assert (tmp_path / "samples.jsonl").read_text() == written
    recipe.write_text(recipe.read_text() + "temprature: 0.5\n")
    assert main(["--config", str(recipe)]) == 2
    assert "temprature" in capsys.readouterr().err


def test_a_gold_answer_that_fails_to_parse_makes_the_problem_unscorable_not_wrong(monkeypatch):
    from opefo_trl import rewards
    from opefo_trl.evaluation import Problem, score_problem

    def broken_gold(gold_text):
        raise rewards.VerificationFailure("math-verify parsing timed out after 10 s")

    monkeypatch.setattr(rewards, "_parse_gold", broken_gold)
    row = score_problem(Problem(0, "1+1?", "2"), [r"\boxed{2}", r"\boxed{3}"])
    assert row["scorable"] is False and row["c"] is None
    assert row["num_verification_failures"] == 2
