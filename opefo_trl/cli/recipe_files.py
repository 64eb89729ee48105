"""Reading recipe files: YAML mappings of option: value, each optionally built on a base recipe.

A recipe may name another recipe as its ``base`` (a path relative to the recipe's own folder); the base's keys are
read first and the recipe's own keys replace them, key by key. A base may have a base of its own. The ``env:``
mapping (environment variables, as TRL reads it) is merged variable by variable. ``opefo-train --config`` (and the
other CLIs) read the merged mapping; every file's keys are checked against the options, naming the file.

Example (``recipes/qwen2.5-math-7b/grpo_strict.yaml``)::

    base: base.yaml
    method: grpo
    output_dir: runs/qwen2.5-math-7b/grpo_strict

    >>> load_recipe("recipes/qwen2.5-math-7b/grpo_strict.yaml")["learning_rate"]  # doctest: +SKIP
    2.83e-06
"""

from __future__ import annotations

import os

BASE_KEY = "base"
ENV_KEY = "env"


class DuplicateRecipeKey(ValueError):
    """A recipe key given twice in one mapping."""


def _unique_key_loader():
    """yaml's SafeLoader, refusing a key given twice in one mapping (safe_load keeps the last without a word)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            first: dict = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in first:
                    raise DuplicateRecipeKey(
                        f"key {key!r} is given twice (lines {first[key] + 1} and {key_node.start_mark.line + 1}); "
                        "keep one."
                    )
                first[key] = key_node.start_mark.line
            return super().construct_mapping(node, deep)

    return UniqueKeyLoader


def _read_mapping(path: str) -> dict:
    """One recipe file's own mapping (its ``base`` key included)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            values = yaml.load(f, Loader=_unique_key_loader())  # a SafeLoader
    except UnicodeDecodeError as err:
        raise ValueError(
            f"Recipe file {path!r} is not UTF-8 text (byte {err.object[err.start : err.end].hex(' ')} at offset "
            f"{err.start}): save it as UTF-8."
        ) from None
    except yaml.YAMLError as err:
        raise ValueError(f"Recipe file {path!r} is not valid YAML: {err}") from err
    except DuplicateRecipeKey as err:
        raise ValueError(f"Recipe file {path!r}: {err}") from None
    if not isinstance(values, dict):
        raise ValueError(f"Recipe file {path!r} must contain a YAML mapping of option: value.")
    if ENV_KEY in values and not isinstance(values[ENV_KEY], dict):
        raise ValueError(f"Recipe file {path!r}: `env` must be a mapping of environment variables (`env: {{A: 1}}`).")
    return values


def read_recipe_chain(path: str) -> list[tuple[str, dict]]:
    """The recipe at ``path`` and its bases as ``[(file, its own keys without base), ...]``, the furthest base first.

    Raises:
        FileNotFoundError: the recipe or one of its bases does not exist.
        ValueError: a file is not a YAML mapping, gives a key twice, has a ``base`` that is not a path, or the bases
            form a cycle.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Recipe file {path!r} does not exist (working directory: {os.getcwd()}).")
    chain: list[tuple[str, dict]] = []
    seen: list[str] = []
    current = path
    while True:
        seen.append(os.path.realpath(current))
        values = _read_mapping(current)
        base = values.pop(BASE_KEY, None)
        chain.append((current, values))
        if base is None:
            return chain[::-1]
        if not isinstance(base, str) or not base.strip():
            raise ValueError(
                f"Recipe file {current!r}: `base: {base}` is not a path; give the base recipe's file, relative to "
                f"this recipe's folder (e.g. `base: base.yaml`)."
            )
        base_path = os.path.join(os.path.dirname(current), base)
        if not os.path.isfile(base_path):
            raise FileNotFoundError(
                f"Recipe file {current!r}: its base {base!r} does not exist (looked for {base_path!r}; a base is "
                "relative to the recipe's folder). A recipe copied out of its folder needs its base too: copy the "
                f"base recipe to {base_path!r}, or set `base:` to the base recipe's path (absolute, or relative to "
                f"{os.path.dirname(os.path.abspath(current))!r})."
            )
        if os.path.realpath(base_path) in seen:
            cycle = " -> ".join(name for name, _ in chain)
            raise ValueError(f"Recipe file {path!r}: its bases form a cycle ({cycle} -> {base_path}); remove one base.")
        current = base_path


def merge_recipe_chain(chain: list[tuple[str, dict]]) -> dict:
    """One mapping from :func:`read_recipe_chain`'s files: later files' keys replace earlier ones; ``env`` merges per
    variable."""
    merged: dict = {}
    env: dict = {}
    for _, values in chain:
        env.update(values.get(ENV_KEY, {}))
        merged.update({key: value for key, value in values.items() if key != ENV_KEY})
    if env:
        merged[ENV_KEY] = env
    return merged


def load_recipe(path: str) -> dict:
    """The merged mapping of the recipe at ``path`` with its bases (:func:`read_recipe_chain`), ``base`` removed."""
    return merge_recipe_chain(read_recipe_chain(path))
