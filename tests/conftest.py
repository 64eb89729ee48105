"""Shared offline fixtures: a tiny local Qwen2-shaped model + ChatML tokenizer, small arithmetic data sets and files."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import pytest


@pytest.fixture(scope="session")
def keep_dtype_rms_norm():
    """``keep_dtype_rms_norm(model) -> model``: a Qwen2 in float64 stays float64 through its RMSNorms."""
    from opefo_trl.tiny import keep_rms_norm_in_model_dtype

    return keep_rms_norm_in_model_dtype


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """Path of a saved random tiny Qwen2 model (hidden 64, 2 layers) with its tokenizer."""
    from opefo_trl.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2") / "model")


@pytest.fixture(scope="session")
def tiny_dataset():
    """16 conversational arithmetic prompts with their answers (TRL's `prompt` + a `solution` column)."""
    from datasets import Dataset

    rows = []
    for i in range(16):
        a, b = i + 2, 3 * i + 1
        rows.append({"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "solution": str(a + b)})
    return Dataset.from_list(rows)


def length_reward(completions, **kwargs):
    """Deterministic and varied within a group, so advantages are non-zero (a reward for training tests)."""
    return [float(len(c[0]["content"]) % 3) for c in completions]


@pytest.fixture(name="length_reward")
def length_reward_fixture():
    return length_reward


def _write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


@pytest.fixture(scope="session")
def write_jsonl():
    """``write_jsonl(path, rows) -> str``: write dicts as JSON lines, return the path."""
    return _write_jsonl


@pytest.fixture(scope="session")
def problems_file(tmp_path_factory):
    """Training data in open-r1/DAPO-Math-17k-Processed's columns: 16 `prompt` problems with their `solution`."""
    rows = [{"prompt": f"What is {i + 2} + {3 * i + 1}?", "solution": str(4 * i + 3)} for i in range(16)]
    return _write_jsonl(tmp_path_factory.mktemp("data") / "problems.jsonl", rows)


@pytest.fixture(scope="session")
def bench_file(tmp_path_factory):
    """A local benchmark `arith.jsonl` in opefo-eval's default columns: 4 problems, i + (i + 1) with gold 2i + 1."""
    rows = [{"problem": f"What is {i} + {i + 1}?", "answer": str(2 * i + 1)} for i in range(4)]
    return _write_jsonl(tmp_path_factory.mktemp("bench") / "arith.jsonl", rows)


@pytest.fixture(scope="session")
def warm_model_path(tiny_model_path, tmp_path_factory):
    """The tiny model after a few supervised steps on fixed answers: peaked policies, away from the entropy maximum
    (near it, a step's first-order entropy change is swamped by curvature)."""
    from opefo_trl.tiny import warm_up_tiny_model

    return warm_up_tiny_model(tiny_model_path, tmp_path_factory.mktemp("warm") / "model")
