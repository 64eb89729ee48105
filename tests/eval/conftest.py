"""Fixtures of the opefo_trl.eval tests: an option factory, a reader of samples.jsonl, and a guard on model loading."""

import json
import os

import pytest

from opefo_trl.eval import EvaluationConfig, TransformersBackend


def _config(model, bench, out, **overrides):
    settings = dict(
        model_name_or_path=model,
        benchmarks=[bench],
        num_samples=3,
        max_new_tokens=6,
        batch_size=4,
        output_dir=str(out),
        backend="transformers",
        dtype="float32",
        progress=False,
    )
    settings.update(overrides)
    return EvaluationConfig(**settings)


def _read_samples(out):
    with open(os.path.join(out, "samples.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return {(r["benchmark"], r["problem_id"], r["sample_index"]): r["completion"] for r in records}, records


@pytest.fixture(scope="session")
def eval_config():
    """``eval_config(model, bench, out, **overrides)``: a small CPU EvaluationConfig (3 samples of 6 tokens, fp32)."""
    return _config


@pytest.fixture(scope="session")
def read_samples():
    """``read_samples(out) -> ({(benchmark, problem, sample): completion}, records)`` from ``out/samples.jsonl``."""
    return _read_samples


@pytest.fixture
def no_model_loading(monkeypatch):
    """Fail the test if the model would be loaded."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(TransformersBackend, "load", refuse)
