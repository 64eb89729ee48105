"""The real-model tier: SmolLM2-135M-Instruct (``opefo_trl.real_model``), run by `make test-real` (-m real_model).

The suite's addopts deselect the tier; a `-m` expression that replaces them without selecting ``real_model`` (as
`make test-fast` and `make test-kernels` give) would run it: its tests are then skipped with the reason, so those
stay as fast as without the tier. Asked for, a missing wheel or gguf is the error that names what installs it."""

import os

import pytest


def pytest_collection_modifyitems(config, items):
    expression = config.getoption("markexpr") or ""
    if "real_model" in expression and "not real_model" not in expression:
        return
    skip = pytest.mark.skip(reason="the real-model tier: `make test-real` installs what it needs and runs it")
    for item in items:
        if item.get_closest_marker("real_model") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def real_model_path() -> str:
    """The plain SmolLM2-135M-Instruct folder (built on first use into the user's cache, ~45 s; then reused)."""
    from opefo_trl.real_model import smollm2_135m_instruct

    return os.fspath(smollm2_135m_instruct())


@pytest.fixture(scope="session")
def arithmetic_prompts():
    """Four one-digit sums in the answer form the 4-bit model sometimes follows, with their answers."""
    from datasets import Dataset

    sums = [(2, 3), (4, 4), (6, 1), (3, 5)]
    return Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": f"What is {a} + {b}? Reply with: The answer is N."}],
                "solution": str(a + b),
            }
            for a, b in sums
        ]
    )
