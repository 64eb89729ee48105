"""opefo_trl.eval.backends: model source, backend choice, vLLM requests (without vLLM), the seeded sampler."""

import importlib.util
import json

import pytest

from opefo_trl.eval import (
    EvaluationConfig,
    Problem,
    ResolvedBenchmark,
    SampleStore,
    build_vllm_requests,
    evaluate,
    pending_jobs,
    resolve_model_source,
    sample_seed,
    select_backend,
    vllm_is_available,
)
from opefo_trl.eval.backends import _group_by_problem, _make_seeded_gumbel_processor
from opefo_trl.eval.benchmarks import BENCHMARKS


def test_backend_choice():
    assert select_backend("auto", vllm_available=False, cuda_available=True) == "transformers"
    assert select_backend("auto", vllm_available=True, cuda_available=False) == "transformers"
    assert select_backend("auto", vllm_available=True, cuda_available=True) == "vllm"
    assert select_backend("transformers", vllm_available=True) == "transformers"
    with pytest.raises(ImportError, match=r"vLLM is not installed.*opefo-trl\[vllm\]"):
        select_backend("vllm", vllm_available=False)
    assert vllm_is_available() is (importlib.util.find_spec("vllm") is not None)


def _aime_jobs(store, seed=3, num_samples=4):
    benchmark = ResolvedBenchmark(BENCHMARKS["aime24"], num_samples=num_samples, k_values=(1,))
    problems = [Problem(0, "q0", "1"), Problem(5, "q5", "2")]
    return pending_jobs(store, benchmark, problems, [[1, 2, 3], [7, 8]], seed=seed)


def test_vllm_requests_one_per_sample_with_its_own_seed(tmp_path):
    config = EvaluationConfig(model_name_or_path="m", temperature=1.0, top_p=0.7, max_new_tokens=64, seed=3)
    jobs = _aime_jobs(SampleStore(str(tmp_path / "fresh")))
    requests = build_vllm_requests(jobs, config)
    prompts = [prompt["prompt_token_ids"] for prompt, _ in requests]
    assert prompts == [[1, 2, 3]] * 4 + [[7, 8]] * 4
    for job, (_, sampling) in zip(jobs, requests, strict=True):
        assert sampling["n"] == 1 and sampling["seed"] == sample_seed(3, "aime24", job.problem_id, job.sample_index)
        assert sampling["temperature"] == 1.0 and sampling["top_p"] == 0.7 and sampling["max_tokens"] == 64
        assert sampling["repetition_penalty"] == 1.0 and sampling["top_k"] == 0
    assert len({sampling["seed"] for _, sampling in requests}) == 8
    assert build_vllm_requests(jobs, config) == requests  # deterministic

    # Problem 5 interrupted after 2 of its 4 samples: the rest are requested with the seeds they had before.
    partial = SampleStore(str(tmp_path / "partial"))
    stored = [(0, i) for i in range(4)] + [(5, 0), (5, 1)]
    partial.append({"benchmark": "aime24", "problem_id": p, "sample_index": i, "completion": "x"} for p, i in stored)
    resumed = build_vllm_requests(_aime_jobs(partial), config)
    assert resumed == requests[-2:]
    reseeded = build_vllm_requests(_aime_jobs(SampleStore(str(tmp_path / "fresh")), seed=4), config)
    assert [s["seed"] for _, s in reseeded] != [s["seed"] for _, s in requests]


def test_vllm_calls_group_whole_problems(tmp_path):
    jobs = _aime_jobs(SampleStore(str(tmp_path)), num_samples=3)
    assert [[(j.problem_id, j.sample_index) for j in group] for group in _group_by_problem(jobs)] == [
        [(0, 0), (0, 1), (0, 2)],
        [(5, 0), (5, 1), (5, 2)],
    ]


def test_greedy_requests_do_not_truncate_the_distribution(tmp_path):
    jobs = _aime_jobs(SampleStore(str(tmp_path)), num_samples=1)
    (_, sampling), _ = build_vllm_requests(jobs, EvaluationConfig(model_name_or_path="m", temperature=0.0))
    assert sampling["temperature"] == 0.0 and sampling["top_p"] == 1.0


def test_seeded_gumbel_sampler_draws_from_the_top_p_distribution():
    import torch
    from transformers import TemperatureLogitsWarper, TopPLogitsWarper

    sampler_cls = _make_seeded_gumbel_processor()
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


def test_missing_model_path(bench_file, tmp_path, eval_config, no_model_loading):
    with pytest.raises(FileNotFoundError, match="Model path '/nonexistent/model' does not exist"):
        evaluate(eval_config("/nonexistent/model", bench_file, tmp_path))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="neither a model"):
        evaluate(eval_config(str(empty), bench_file, tmp_path / "out"))
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/nonexistent/base"}))
    with pytest.raises(FileNotFoundError, match="base model '/nonexistent/base' of adapter"):
        evaluate(eval_config(str(adapter), bench_file, tmp_path / "out"))
    assert resolve_model_source("Qwen/Qwen2.5-Math-7B").model_path == "Qwen/Qwen2.5-Math-7B"  # a hub id


def test_a_model_or_adapter_folder_without_weights_is_named(tiny_model_path, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=rf"^{tmp_path} holds no weights \(no \*.safetensors"):
        resolve_model_source(str(tmp_path))
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": tiny_model_path}))
    with pytest.raises(FileNotFoundError, match=rf"^{adapter} holds no weights"):
        resolve_model_source(str(adapter))
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    assert resolve_model_source(str(adapter)).model_path == tiny_model_path
