"""opefo_trl.eval.store: per-sample seeds, pending jobs and the resumable samples.jsonl."""

import json

import pytest

from opefo_trl.eval import Problem, ResolvedBenchmark, SampleStore, load_problems, pending_jobs, sample_seed
from opefo_trl.eval.benchmarks import BENCHMARKS


def _record(problem_id, sample_index, completion="x", fingerprint="f"):
    return {
        "benchmark": "aime24",
        "problem_id": problem_id,
        "sample_index": sample_index,
        "fingerprint": fingerprint,
        "seed": sample_seed(0, "aime24", problem_id, sample_index),
        "completion": completion,
        "num_tokens": 1,
        "finish_reason": "stop",
    }


def test_sample_seed_depends_on_every_part_and_nothing_else():
    seeds = {
        sample_seed(seed, bench, problem, sample)
        for seed in (0, 1)
        for bench in ("aime24", "amc23")
        for problem in (0, 1)
        for sample in (0, 1)
    }
    assert len(seeds) == 16 and all(0 <= s < 2**63 for s in seeds)
    assert sample_seed(3, "aime24", 7, 2) == sample_seed(3, "aime24", 7, 2)
    # Fixed across versions: a resumed output_dir keeps drawing with the seeds its first part was drawn with.
    assert sample_seed(0, "aime24", 0, 0) == 8735653856042051794


def test_pending_jobs_of_a_partly_stored_problem_keep_their_seeds(tmp_path):
    benchmark = ResolvedBenchmark(BENCHMARKS["aime24"], num_samples=4, k_values=(1,))
    problems = [Problem(0, "q0", "1"), Problem(1, "q1", "2")]
    prompt_ids = [[1, 2], [3]]
    store = SampleStore(str(tmp_path / "fresh"))
    everything = pending_jobs(store, benchmark, problems, prompt_ids, seed=5)
    assert [(j.problem_id, j.sample_index) for j in everything] == [(p, i) for p in (0, 1) for i in range(4)]
    assert [j.seed for j in everything] == [sample_seed(5, "aime24", j.problem_id, j.sample_index) for j in everything]

    partial = SampleStore(str(tmp_path / "partial"))
    partial.append([_record(0, i, fingerprint=problems[0].fingerprint) for i in range(4)])
    partial.append([_record(1, i, fingerprint=problems[1].fingerprint) for i in range(2)])  # problem 1 half done
    rest = pending_jobs(partial, benchmark, problems, prompt_ids, seed=5)
    assert [(j.problem_id, j.sample_index) for j in rest] == [(1, 2), (1, 3)]
    assert rest == everything[-2:]  # same prompt, same seed as in an uninterrupted run


def test_store_reloads_and_drops_a_truncated_last_line(tmp_path, caplog):
    store = SampleStore(str(tmp_path))
    store.append([_record(0, 0, "a"), _record(0, 1, "b")])
    with open(tmp_path / "samples.jsonl", "a") as f:
        f.write('{"benchmark": "aime24", "probl')  # a write cut short by a kill
    with caplog.at_level("WARNING"):
        reloaded = SampleStore(str(tmp_path))
    assert "truncated last line" in caplog.text
    assert reloaded.get("aime24", 0, 1)["completion"] == "b" and reloaded.get("aime24", 0, 2) is None
    assert [json.loads(line)["sample_index"] for line in open(tmp_path / "samples.jsonl")] == [0, 1]


def test_store_refuses_a_corrupt_line_in_the_middle(tmp_path):
    (tmp_path / "samples.jsonl").write_text('{"broken"\n' + json.dumps(_record(0, 0)) + "\n")
    with pytest.raises(ValueError, match=r"samples.jsonl, line 1, is not valid JSON"):
        SampleStore(str(tmp_path))


@pytest.mark.parametrize("line", ['{"benchmark": "aime24", "problem_id": 0}', "[1, 2]", '"a sample"'])
def test_store_refuses_a_valid_json_line_that_is_not_a_sample(tmp_path, snapshot, line):
    (tmp_path / "samples.jsonl").write_text(json.dumps(_record(0, 0)) + "\n" + line + "\n")
    before = snapshot(tmp_path)
    with pytest.raises(ValueError) as error:
        SampleStore(str(tmp_path))
    message = str(error.value)
    assert message.startswith(f"{tmp_path / 'samples.jsonl'}, line 2, is not a stored sample (no ")
    assert "sample_index, fingerprint, completion" in message and line in message
    assert message.endswith(
        "Fix or remove that line, or discard every stored sample with overwrite=True (--overwrite true)."
    )
    assert snapshot(tmp_path) == before


def test_store_refuses_other_settings_or_changed_problems(tmp_path):
    store = SampleStore(str(tmp_path))
    store.check_settings({"temperature": 1.0, "seed": 0})
    store.append([_record(0, 0, fingerprint=Problem(0, "q", "1").fingerprint)])
    again = SampleStore(str(tmp_path))
    again.check_settings({"temperature": 1.0, "seed": 0})
    with pytest.raises(ValueError, match=r"other settings \(seed: 0 -> 1\).*overwrite"):
        again.check_settings({"temperature": 1.0, "seed": 1})
    with pytest.raises(ValueError, match="problem 0 were drawn for a different question or answer"):
        again.check_problems("aime24", [Problem(0, "q", "2")])
    assert SampleStore(str(tmp_path), overwrite=True).samples == {}


def test_local_benchmark_problems_are_fingerprinted(bench_file):
    from opefo_trl.eval import EvaluationConfig, resolve_benchmarks

    (bench,) = resolve_benchmarks(EvaluationConfig(model_name_or_path="m", benchmarks=[bench_file]))
    problems = load_problems(bench)
    assert len({p.fingerprint for p in problems}) == len(problems) == 4
    assert Problem(0, "What is 0 + 1?", "1").fingerprint == problems[0].fingerprint


def test_a_whole_last_line_without_its_newline_gets_it_back_before_the_next_append(tmp_path, caplog):
    """Otherwise the next record is glued onto it (2 samples lost, then a hard error)."""
    (tmp_path / "samples.jsonl").write_text(json.dumps(_record(0, 0, "a")))  # killed between the record and "\n"
    with caplog.at_level("WARNING"):
        store = SampleStore(str(tmp_path))
    assert "Added the newline missing at the end of" in caplog.text
    store.append([_record(0, 1, "b"), _record(0, 2, "c")])
    reloaded = SampleStore(str(tmp_path))
    assert [reloaded.get("aime24", 0, i)["completion"] for i in range(3)] == ["a", "b", "c"]


def test_store_refuses_samples_of_other_model_files_or_unrecorded_ones(tmp_path):
    from opefo_trl.eval.store import MODEL_FILES_KEY

    store = SampleStore(str(tmp_path))
    store.check_settings({"temperature": 1.0})  # a store without model files recorded
    store.append([_record(0, 0)])
    with pytest.raises(ValueError) as error:
        SampleStore(str(tmp_path)).check_settings({"temperature": 1.0, MODEL_FILES_KEY: {"model/config.json": "x"}})
    assert str(error.value) == (
        f"{tmp_path} holds 1 samples drawn from model files (tokenizer, chat template, config, generation config) "
        "it has no record of (a store written without them). Use another output_dir, or overwrite=True "
        "(--overwrite true) to discard them and sample the current model files."
    )
