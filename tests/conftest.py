"""Shared offline fixtures: a tiny local Qwen2-shaped model + ChatML tokenizer and a small arithmetic data set."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import pytest


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
