"""The README's code blocks that tests run as they are written there (tests/test_readme.py,
tests/real_model/test_real_readme.py): each is found by the HTML comment right above it, so the two cannot drift."""

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_text() -> str:
    return README.read_text(encoding="utf-8")


def readme_block(marker: str) -> str:
    """The ```python block right after ``marker``, which README.md must hold once."""
    text = readme_text()
    assert text.count(marker) == 1, f"README.md must hold the marker {marker!r} once, right above its code block"
    block = re.match(r"\s*```python\n(.*?)\n```", text.split(marker, 1)[1], re.DOTALL)
    assert block is not None, f"the marker {marker!r} must be followed by a ```python block"
    return block.group(1)


#: Above the first screen's CPU variant on the real model, which tests/real_model/test_real_readme.py runs.
REAL_MODEL_CPU_MARKER = (
    "<!-- real-model CPU example: tests/real_model/test_real_readme.py runs the next code block, 2 steps -->"
)
