"""opefo_trl.eval.benchmarks: the registry, loading from the hub or local files, k <= n, prompts."""

import pytest

from opefo_trl.data.rewards import score_completion
from opefo_trl.eval import (
    BENCHMARKS,
    EvaluationConfig,
    build_prompt_ids,
    context_length_warning,
    evaluate,
    load_problems,
    resolve_benchmarks,
)


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
    with pytest.raises(FileNotFoundError, match=r"math500.*HuggingFaceH4/MATH-500.*benchmark_files=math500=PATH"):
        load_problems(bench)


def test_local_stand_ins_of_hub_formats(tmp_path, write_jsonl):
    import datasets

    # OlympiadBench: `question` + `final_answer` as a list; AMC23: `question` + numeric `answer`.
    olympiad = tmp_path / "olympiad.parquet"
    datasets.Dataset.from_list(
        [
            {"question": "Find x and y.", "final_answer": ["$1$", "$2$"]},
            {"question": "Half?", "final_answer": ["$\\frac{1}{2}$"]},
        ]
    ).to_parquet(str(olympiad))
    amc = write_jsonl(tmp_path / "amc.jsonl", [{"question": "3 * 9?", "answer": 27.0}])
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


def test_missing_local_benchmark_file_is_named(tmp_path):
    (bench,) = resolve_benchmarks(EvaluationConfig(model_name_or_path="m", benchmarks=[str(tmp_path / "gone.jsonl")]))
    with pytest.raises(FileNotFoundError, match=r"Data file '.*gone.jsonl' does not exist"):
        load_problems(bench)


def test_max_problems_takes_the_first_rows(bench_file):
    (bench,) = resolve_benchmarks(EvaluationConfig(model_name_or_path="m", benchmarks=[bench_file]))
    assert [p.problem_id for p in load_problems(bench, max_problems=2)] == [0, 1]
    assert bench.name == "arith" and bench.k_values == (1,)


def test_prompts_are_rendered_as_training_renders_them(tiny_model_path, bench_file):
    from datasets import Dataset
    from transformers import AutoTokenizer

    from opefo_trl.data.loading import prompt_token_lengths
    from opefo_trl.data.prompts import format_prompt

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    (bench,) = resolve_benchmarks(EvaluationConfig(model_name_or_path="m", benchmarks=[bench_file]))
    problems = load_problems(bench)
    ids = build_prompt_ids(tokenizer, problems, "qwen_math_boxed")
    text = tokenizer.decode(ids[1])
    assert text.startswith("<|im_start|>system\nPlease reason step by step")
    assert text.endswith("<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n")
    chats = Dataset.from_dict({"prompt": [format_prompt(p.question, "qwen_math_boxed") for p in problems]})
    assert [len(x) for x in ids] == prompt_token_lengths(chats, tokenizer)  # what opefo-train checks


def test_unknown_benchmark_lists_valid_names(tiny_model_path, tmp_path, eval_config, no_model_loading):
    with pytest.raises(ValueError, match=r"Unknown benchmark 'aime2024'.*aime24, aime25, amc23, math500, minerva"):
        evaluate(eval_config(tiny_model_path, "aime2024", tmp_path))


def test_missing_column_lists_the_columns(tiny_model_path, tmp_path, eval_config, write_jsonl, no_model_loading):
    bench = write_jsonl(tmp_path / "qa.jsonl", [{"question": "1+1?", "solution": "2"}])
    with pytest.raises(ValueError, match=r"no column 'problem'; its columns are \['question', 'solution'\]"):
        evaluate(eval_config(tiny_model_path, bench, tmp_path / "out"))


def test_k_larger_than_n_is_refused_before_generation(
    tiny_model_path, bench_file, tmp_path, eval_config, no_model_loading
):
    with pytest.raises(ValueError, match=r"pass@8 was requested but benchmark 'arith' is sampled n=3 times"):
        evaluate(eval_config(tiny_model_path, bench_file, tmp_path, pass_at_k=[1, 8]))
    # The paper protocol: n=1 on MATH500, so pass@4 there is an error too.
    with pytest.raises(ValueError, match="'math500' is sampled n=1"):
        resolve_benchmarks(EvaluationConfig(model_name_or_path="m", benchmarks=["aime24", "math500"], pass_at_k=[4]))


def test_context_length_warning():
    assert context_length_warning([[1] * 10, [1] * 30], 994, 1024) is None
    assert "longest prompt (30 tokens) plus max_new_tokens=995" in context_length_warning(
        [[1] * 10, [1] * 30], 995, 1024
    )
