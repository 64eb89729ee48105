"""The optional dependencies, asked for by the name of the extra that installs them.

`pip install opefo-trl` installs the trainer alone; the math-verify reward and the plots come with extras
(``opefo-trl[math]``, ``opefo-trl[plot]``; ``dev`` has both). Code that needs one imports it inside
:func:`needs_extra`, which turns the missing module into one ImportError naming the extra to install.

Example:
    >>> with needs_extra("plot", "matplotlib", "opefo-plot"):
    ...     import matplotlib
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

#: extra -> what it installs, as pip names it.
EXTRAS = {"math": "math-verify", "plot": "matplotlib", "real-model": "gguf"}


def missing_extra_message(extra: str, purpose: str) -> str:
    """The one sentence every missing optional dependency is reported with."""
    return (
        f"{purpose} needs {EXTRAS[extra]}, which opefo-trl installs with its `{extra}` extra: "
        f"`pip install 'opefo-trl[{extra}]'` (or `pip install {EXTRAS[extra]}`)."
    )


@contextmanager
def needs_extra(extra: str, module: str, purpose: str) -> Iterator[None]:
    """Import ``module`` (the top-level name) inside this block; if it is missing, raise ImportError naming ``extra``.

    A missing module other than ``module`` (a broken installation of it, say) is re-raised as it is.
    """
    if extra not in EXTRAS:
        raise ValueError(f"Unknown extra {extra!r}: choose one of {sorted(EXTRAS)}.")
    try:
        yield
    except ModuleNotFoundError as err:
        if (err.name or "").split(".")[0] != module:
            raise
        raise ImportError(missing_extra_message(extra, purpose), name=module) from err


def require_extra(extra: str, module: str, purpose: str) -> None:
    """Check up front (before a model loads or a run trains) that ``module`` can be imported."""
    with needs_extra(extra, module, purpose):
        __import__(module)
