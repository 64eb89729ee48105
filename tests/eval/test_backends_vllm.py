"""opefo-eval's vLLM backend on the real engine (vLLM's CPU build; `make test-vllm`): the transformers backend's
results on a greedy case, and an interrupted evaluation resumed without drawing any sample twice."""

import pytest

from opefo_trl.eval import VLLMBackend, evaluate

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

NUM_PROBLEMS = 4  # rows of the bench_file fixture


def greedy(model, bench, out, eval_config, backend):
    return eval_config(
        model, bench, out, backend=backend, temperature=0.0, num_samples=2, max_new_tokens=8, vllm_problems_per_call=1
    )


@pytest.fixture(scope="module")
def warm_vllm_model(vllm_model_path, tmp_path_factory):
    """The head-size-32 tiny model after a few supervised steps: peaked, so greedy completions are answers ("1 1 3")
    rather than one repeated newline (a comparison that could hardly tell backends apart)."""
    from opefo_trl.testing import warm_up_tiny_model

    return warm_up_tiny_model(vllm_model_path, tmp_path_factory.mktemp("warm-vllm") / "model")


@pytest.fixture(scope="module")
def transformers_run(warm_vllm_model, bench_file, tmp_path_factory, eval_config, read_samples):
    out = tmp_path_factory.mktemp("transformers")
    results = evaluate(greedy(warm_vllm_model, bench_file, out, eval_config, "transformers"))
    samples = read_samples(out)[0]
    assert all(len(set(completion)) > 1 for completion in samples.values())  # not one repeated character
    return results, samples


def test_vllm_backend_matches_transformers_greedy(
    transformers_run, warm_vllm_model, bench_file, tmp_path, eval_config, read_samples
):
    """Greedy decoding in float32: the same completions, hence the same answers, pass@k and avg@k."""
    results, samples = transformers_run
    served = evaluate(greedy(warm_vllm_model, bench_file, tmp_path, eval_config, "vllm"))
    assert read_samples(tmp_path)[0] == samples
    expected, got = results["benchmarks"]["arith"], served["benchmarks"]["arith"]
    assert got["metrics"] == expected["metrics"]
    assert [row["answers"] for row in got["problems"]] == [row["answers"] for row in expected["problems"]]


def test_vllm_evaluation_resumes_drawing_nothing_twice(
    transformers_run, warm_vllm_model, bench_file, tmp_path, eval_config, read_samples, monkeypatch
):
    """Killed after its first call (one problem's samples stored), a rerun draws only the other problems' samples."""
    run = VLLMBackend.run
    drawn = []

    def interrupted(self, jobs):
        for batch, samples in run(self, jobs):
            drawn.append([(job.problem_id, job.sample_index) for job in batch])
            yield batch, samples
            raise KeyboardInterrupt  # as if the process were killed after the first call's samples were written

    monkeypatch.setattr(VLLMBackend, "run", interrupted)
    config = greedy(warm_vllm_model, bench_file, tmp_path, eval_config, "vllm")
    with pytest.raises(KeyboardInterrupt):
        evaluate(config)
    assert sorted(read_samples(tmp_path)[0]) == [("arith", 0, 0), ("arith", 0, 1)]

    def counted(self, jobs):
        for batch, samples in run(self, jobs):
            drawn.append([(job.problem_id, job.sample_index) for job in batch])
            yield batch, samples

    drawn.clear()
    monkeypatch.setattr(VLLMBackend, "run", counted)
    resumed = evaluate(config)
    assert [pair for batch in drawn for pair in batch] == [(p, i) for p in range(1, NUM_PROBLEMS) for i in range(2)]
    samples, records = read_samples(tmp_path)
    assert len(records) == NUM_PROBLEMS * 2 and samples == transformers_run[1]
    assert resumed["benchmarks"]["arith"]["metrics"] == transformers_run[0]["benchmarks"]["arith"]["metrics"]
