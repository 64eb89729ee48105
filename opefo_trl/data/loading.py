"""Math training data for RLVR: problems as TRL conversational prompts plus a gold-answer `solution` column.

Every loader returns a `datasets.Dataset` with exactly two columns, the contract of `OPEFOTrainer` /
`GRPOTrainer` with `opefo_trl.data.rewards.math_accuracy_reward`:

- `prompt`: the problem as a chat (a list of `{"role", "content"}` messages) built by
  `opefo_trl.data.prompts.format_prompt(problem, template)`;
- `solution`: the gold final answer as a string (what the verifier compares the completion with).

Presets (`DATASET_PRESETS`) cover the data sets of the OPEFO comparison and two common alternatives:

| preset | hub id (config) | problem | gold answer |
|---|---|---|---|
| `dapo-math-17k` | `open-r1/DAPO-Math-17k-Processed` (`en`) | `prompt` | `solution` |
| `dapo-math-17k-raw` | `BytedTsinghua-SIA/DAPO-Math-17k` | `prompt` user turn | `reward_model.ground_truth` |
| `math-lighteval` | `DigitalLearningGmbH/MATH-lighteval` | `problem` | last `\\boxed{...}` of `solution` |
| `gsm8k` | `openai/gsm8k` (`main`) | `question` | text after `####` in `answer` |

The raw DAPO set is deduplicated by problem text (its instruction removed). Any other hub id, local data set directory,
or local JSON / JSONL / Parquet / CSV file works too, with the problem and answer columns named explicitly. `data_files`
replaces the hub download with local files of the preset's format (offline runs and tests).

Local data files, for training and for ``opefo-eval``'s local benchmarks: :func:`local_file_builder` checks JSON /
JSONL / Parquet / CSV files and names the `datasets` builder that reads them; :func:`load_local_files` loads them.

Examples:
    >>> ds = load_math_dataset("gsm8k", template="qwen_math_boxed")  # doctest: +SKIP
    >>> ds.column_names  # doctest: +SKIP
    ['prompt', 'solution']
    >>> ds = load_math_dataset(  # doctest: +SKIP
    ...     "local", data_files=["problems.jsonl"], problem_column="question", answer_column="answer",
    ...     template="qwen_math_boxed",
    ... )
    >>> extract_boxed_answer(r"so the sum is $\\boxed{\\frac{1}{2}}$.")
    '\\\\frac{1}{2}'
    >>> extract_gsm8k_answer("3 + 4 = 7 apples.\\n#### 7")
    '7'
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

from opefo_trl.data.prompts import gold_to_text, render_prompts

logger = logging.getLogger(__name__)

LOCAL_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
"""File extension -> `datasets` builder of the local data files every loader accepts."""

ANSWER_FORMATS = ("plain", "boxed", "gsm8k")
"""How the gold answer is stored in the answer column: as-is, inside the last ``\\boxed{}``, or after ``####``."""


@dataclass(frozen=True)
class DatasetPreset:
    """Where a known data set lives and how its problem and gold answer are stored."""

    hub_id: str
    config: str | None
    problem_column: str
    answer_column: str
    answer_format: str = "plain"
    deduplicate: bool = False
    unwrap_dapo_instruction: bool = False
    description: str = ""


DATASET_PRESETS: dict[str, DatasetPreset] = {
    "dapo-math-17k": DatasetPreset(
        hub_id="open-r1/DAPO-Math-17k-Processed",
        config="en",
        problem_column="prompt",
        answer_column="solution",
        description="DAPO-Math-17k, deduplicated by open-r1 (~14k problems); the OPEFO paper's training set.",
    ),
    "dapo-math-17k-raw": DatasetPreset(
        hub_id="BytedTsinghua-SIA/DAPO-Math-17k",
        config=None,
        problem_column="prompt",
        answer_column="reward_model.ground_truth",
        deduplicate=True,
        unwrap_dapo_instruction=True,
        description=(
            "DAPO-Math-17k as released (~1.79M rows, each problem repeated); deduplicated by problem text. DAPO's "
            "embedded instruction ('... Answer: $Answer ...') is removed from the problem; the `dapo` template "
            "puts it back verbatim."
        ),
    ),
    "math-lighteval": DatasetPreset(
        hub_id="DigitalLearningGmbH/MATH-lighteval",
        config=None,
        problem_column="problem",
        answer_column="solution",
        answer_format="boxed",
        description="MATH (Hendrycks et al.), 7.5k train problems; the gold answer is the solution's last \\boxed{}.",
    ),
    "gsm8k": DatasetPreset(
        hub_id="openai/gsm8k",
        config="main",
        problem_column="question",
        answer_column="answer",
        answer_format="gsm8k",
        description="GSM8K grade-school arithmetic, 7.5k train problems; the gold answer follows '####'.",
    ),
}


def is_local_data_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a local data file by its extension (it need not exist).

    >>> is_local_data_file("data/aime.parquet"), is_local_data_file("HuggingFaceH4/aime_2024")
    (True, False)
    """
    return os.path.splitext(os.fspath(path))[1].lower() in LOCAL_FILE_BUILDERS


def _as_file_list(data_files: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    if isinstance(data_files, (str, os.PathLike)):
        data_files = [data_files]
    return [os.fspath(path) for path in data_files]


def local_file_builder(data_files: str | os.PathLike | Sequence[str | os.PathLike]) -> str:
    """The `datasets` builder (json / parquet / csv) for local files, checking that they exist and agree.

    >>> local_file_builder(["/nonexistent.txt"])
    Traceback (most recent call last):
    ...
    FileNotFoundError: Data file '/nonexistent.txt' does not exist.
    """
    files = _as_file_list(data_files)
    if not files:
        raise ValueError("data_files is empty: give at least one local JSON / JSONL / Parquet / CSV file.")
    builders = set()
    for path in files:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"Data file {path!r} does not exist.")
        if _is_blank(path):  # `datasets` fails on it with a bare StopIteration
            raise ValueError(f"Data file {path!r} is empty; give a file with at least one row.")
        extension = os.path.splitext(path)[1].lower()
        if extension not in LOCAL_FILE_BUILDERS:
            raise ValueError(
                f"Data file {path!r} has an unsupported extension {extension!r}; use one of "
                f"{', '.join(LOCAL_FILE_BUILDERS)}."
            )
        builders.add(LOCAL_FILE_BUILDERS[extension])
        if LOCAL_FILE_BUILDERS[extension] == "json":
            check_json_rows(path)
    if len(builders) > 1:
        raise ValueError(f"All data files must have one format, got a mix of {sorted(builders)}: {files}.")
    return builders.pop()


def check_json_rows(path: str) -> None:
    r"""Refuse a JSON / JSONL data file `datasets` would fail on with a traceback, naming the first bad line: JSON lines
    (one object per line) unless the file is one JSON document (an array of objects, or an object of columns).

    >>> import tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "rows.jsonl")
    >>> _ = open(path, "w").write('{"a": 1}\n{"a": 2,\n')
    >>> check_json_rows(path)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: Data file '...rows.jsonl', line 2, is not a JSON object (Expecting property name ...
    """
    with open(path, encoding="utf-8", errors="replace") as f:
        head = f.read(1 << 16).lstrip()
    if head.startswith("[") or (head.startswith("{") and not _is_json_object(head.split("\n", 1)[0])):
        try:  # one document; json.load names the line of a syntax error
            with open(path, encoding="utf-8") as f:
                json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(
                f"Data file {path!r} is not valid JSON ({err}); fix it, or write one object per line."
            ) from None
        return
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as err:
                reason = f"{err.msg}: column {err.colno}"
            else:
                if isinstance(row, dict):
                    continue
                reason = f"a {type(row).__name__}"
            raise ValueError(
                f"Data file {path!r}, line {number}, is not a JSON object ({reason}): every line of a JSON-lines file "
                'is one row, {"column": value, ...}; fix or remove that line.'
            )


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def _is_blank(path: str, chunk_size: int = 1 << 16) -> bool:
    """Whether a file holds nothing but whitespace (read up to its first other byte)."""
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            if chunk.strip():
                return False
    return True


def check_datasets_cache() -> None:
    """Refuse a datasets cache this process cannot write (a read-only ``HF_HOME``, an unwritable ``HOME``): datasets
    writes every data set it loads there, local files included, and would fail with a traceback."""
    from datasets import config

    from opefo_trl.runs.files import unwritable_reason

    cache = str(config.HF_DATASETS_CACHE)
    reason = unwritable_reason(cache)
    if reason:
        raise ValueError(
            f"The datasets cache {cache} cannot be written ({reason}); datasets stores every data set it loads "
            "there. Set HF_DATASETS_CACHE (or HF_HOME) to a folder this user can write to."
        )


def load_local_files(data_files: str | os.PathLike | Sequence[str | os.PathLike], split: str = "train"):
    """Load local JSON / JSONL / Parquet / CSV files (one format) as one `datasets.Dataset` named ``split``."""
    from datasets import load_dataset

    builder = local_file_builder(data_files)
    return load_dataset(builder, data_files={split: _as_file_list(data_files)}, split=split)


def _braced_content(text: str, open_index: int) -> str | None:
    """Content of the brace group opening at ``text[open_index] == "{"``, or None when it never closes."""
    depth = 0
    for i in range(open_index, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[open_index + 1 : i]
    return None


def extract_boxed_answer(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, nested braces included; None if absent.

    ``\\boxed 5`` (no braces, as in a few MATH solutions) yields ``"5"``.

        >>> extract_boxed_answer(r"$x = \\boxed{2^{10}}$ and not \\boxed 3")
        '3'
        >>> extract_boxed_answer("no box") is None
        True
    """
    if not isinstance(text, str):
        return None
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest_index = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    rest = text[rest_index:]
    stripped = rest.lstrip()
    if stripped.startswith("{"):
        content = _braced_content(text, rest_index + (len(rest) - len(stripped)))
        return content.strip() if content is not None and content.strip() else None
    if rest.startswith(" "):
        # `\boxed 5$`: the answer runs to the next whitespace or `$`.
        token = stripped.split("$")[0].split()
        return token[0] if token else None
    return None


def extract_gsm8k_answer(text: str) -> str | None:
    """The final answer after ``####`` in a GSM8K solution, thousands separators removed; None if absent.

    >>> extract_gsm8k_answer("She pays 1,200 dollars.\\n#### 1,200")
    '1200'
    """
    if not isinstance(text, str) or "####" not in text:
        return None
    answer = text.rsplit("####", 1)[1].strip().replace(",", "")
    return answer or None


def _plain_answer(value) -> str | None:
    """The gold answer as text; a list (several values, as in OlympiadBench) becomes ``a, b`` like the verifier's."""
    if value is None:
        return None
    answer = gold_to_text(value)
    return answer or None


def _check_gold_type(value, *, row: int, column: str, answer_format: str) -> None:
    """Refuse a gold answer that would reach the rewards as a Python repr: a mapping, a bool, or anything but text (and,
    for ``answer_format='plain'``, a number or a list of them).

    >>> _check_gold_type({"v": "27"}, row=3, column="answer", answer_format="plain")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: The gold answer in column 'answer', row 3, is a dict ({'v': '27'}): ...
    """
    if value is None:
        return
    plain = answer_format == "plain"
    allowed: tuple[type, ...] = (str, int, float) if plain else (str,)
    for item in value if plain and isinstance(value, (list, tuple)) else [value]:
        if isinstance(item, bool) or not isinstance(item, allowed):
            kinds = "text, a number, or a list of them" if plain else f"text (answer_format={answer_format!r})"
            raise ValueError(
                f"The gold answer in column {column!r}, row {row}, is a {type(item).__name__} ({item!r:.100}): gold "
                f"answers must be {kinds}, or it would reach the reward functions as {str(item)!r:.100}. Fix that row, "
                "or point answer_column at the field that holds the answer (a dotted name such as "
                "'reward_model.ground_truth')."
            )


_ANSWER_EXTRACTORS = {"plain": _plain_answer, "boxed": extract_boxed_answer, "gsm8k": extract_gsm8k_answer}


def _describe_columns(dataset) -> str:
    parts = []
    for name, feature in dataset.features.items():
        if isinstance(feature, dict):
            parts.append(f"{name} (with fields {', '.join(feature)})")
        else:
            parts.append(name)
    return ", ".join(parts)


def _check_column(dataset, column: str, *, role: str, option: str, source: str) -> None:
    """Raise a ValueError naming ``column`` and the available columns when ``column`` is not in ``dataset``.

    ``column`` may be dotted (``reward_model.ground_truth``) to address a field of a struct column.
    """
    top, _, field_name = column.partition(".")
    features = dataset.features
    missing = top not in features
    if not missing and field_name:
        feature = features[top]
        missing = not (isinstance(feature, dict) and field_name in feature)
    if missing:
        raise ValueError(
            f"The {role} column {column!r} is missing from data set {source!r}. Available columns: "
            f"{_describe_columns(dataset)}. Set `{option}` to the column that holds the {role}."
        )


def _column_values(dataset, column: str):
    """The column (or struct field, for a dotted name) as one Arrow array: ~10x faster than Python rows."""
    import pyarrow as pa
    import pyarrow.compute as pc

    top, _, field_name = column.partition(".")
    values = dataset.with_format("arrow")[top]
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    return pc.struct_field(values, field_name) if field_name else values


def _problem_texts(values, column: str) -> list[str]:
    """Problem texts from an Arrow column of strings, or of chats (the last user turn of each)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    value_type = values.type
    if pa.types.is_string(value_type) or pa.types.is_large_string(value_type):
        rows = values.to_pylist()
    elif (
        pa.types.is_list(value_type)
        and pa.types.is_struct(value_type.value_type)
        and {"role", "content"} <= {f.name for f in value_type.value_type}
    ):
        messages = pc.list_flatten(values)
        parents = pc.list_parent_indices(values).to_pylist()
        roles = pc.struct_field(messages, "role").to_pylist()
        contents = pc.struct_field(messages, "content").to_pylist()
        rows = [None] * len(values)
        for row, role, content in zip(parents, roles, contents, strict=True):
            if role == "user":
                rows[row] = content
        missing = next((i for i, text in enumerate(rows) if not isinstance(text, str)), None)
        if missing is not None:
            _problem_text(values[missing].as_py(), row=missing, column=column)  # raises with the row shown
    else:
        rows = values.to_pylist()
    return [_problem_text(value, row=i, column=column) for i, value in enumerate(rows)]


def unwrap_dapo_instruction(text: str) -> str:
    """The bare problem of a DAPO-Math-17k user prompt (its instruction prefix and reminder suffix removed).

    Text without DAPO's wrapper is returned unchanged, so ``format_prompt(problem, "dapo")`` reproduces the original
    prompt exactly.

        >>> from opefo_trl.data.prompts import format_prompt
        >>> unwrap_dapo_instruction(format_prompt("What is 1 + 1?", "dapo")[0]["content"])
        'What is 1 + 1?'
    """
    from opefo_trl.data.prompts import DAPO_USER_PROMPT, PROBLEM_PLACEHOLDER

    prefix, suffix = DAPO_USER_PROMPT.split(PROBLEM_PLACEHOLDER)
    if text.startswith(prefix) and text.endswith(suffix) and len(text) > len(prefix) + len(suffix):
        return text[len(prefix) : len(text) - len(suffix)].strip()
    return text


def _problem_text(value, *, row: int, column: str) -> str:
    """The problem as text: a string as-is, or the content of the last user turn of a chat list."""
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, (list, tuple)) and value and all(isinstance(m, dict) for m in value):
        user_turns = [m.get("content") for m in value if m.get("role") == "user"]
        if user_turns and isinstance(user_turns[-1], str):
            return user_turns[-1].strip()
    raise ValueError(
        f"Row {row} of the problem column {column!r} is neither text nor a chat with a user turn: {value!r:.200}. "
        "Point `problem_column` at the problem text."
    )


def resolve_dataset_source(
    name: str,
    *,
    config: str | None = None,
    problem_column: str | None = None,
    answer_column: str | None = None,
    answer_format: str | None = None,
    deduplicate: bool | None = None,
) -> DatasetPreset:
    """The preset for ``name`` with any explicit setting applied, or a custom source; raises on incomplete input.

    Cheap and offline, so that a launcher can validate its data options before loading anything.

        >>> resolve_dataset_source("gsm8k").answer_format
        'gsm8k'
        >>> resolve_dataset_source("local", problem_column="q", answer_column="a").problem_column
        'q'
    """
    if answer_format is not None and answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}.")
    if name in DATASET_PRESETS:
        preset = DATASET_PRESETS[name]
        return DatasetPreset(
            hub_id=preset.hub_id,
            config=config if config is not None else preset.config,
            problem_column=problem_column or preset.problem_column,
            answer_column=answer_column or preset.answer_column,
            answer_format=answer_format or preset.answer_format,
            deduplicate=preset.deduplicate if deduplicate is None else deduplicate,
            unwrap_dapo_instruction=preset.unwrap_dapo_instruction,
            description=preset.description,
        )
    if not (problem_column and answer_column):
        given = (("problem_column", problem_column), ("answer_column", answer_column))
        missing = [option for option, value in given if not value]
        raise ValueError(
            f"Data set {name!r} is not a preset ({', '.join(DATASET_PRESETS)}), so its columns must be given: set "
            f"{' and '.join(f'`{m}`' for m in missing)}."
        )
    return DatasetPreset(
        hub_id=name,
        config=config,
        problem_column=problem_column,
        answer_column=answer_column,
        answer_format=answer_format or "plain",
        deduplicate=bool(deduplicate),
        description="custom data set",
    )


def check_config_for_files(config: str | None, data_files: Sequence[str] | None) -> None:
    """Refuse a hub configuration given with local files, which have none (`datasets` would ignore it).

    >>> check_config_for_files("main", ["data/train.jsonl"])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: dataset_config 'main' names a configuration of a hub data set, but dataset_files reads local files, ...
    """
    if config is not None and data_files:
        raise ValueError(
            f"dataset_config {config!r} names a configuration of a hub data set, but dataset_files reads local files, "
            "which have none: drop dataset_config, or drop dataset_files to load that configuration from the hub."
        )


def _load_raw(source: DatasetPreset, *, name: str, split: str, data_files: Sequence[str] | None):
    from datasets import load_dataset

    if data_files:
        return load_local_files(data_files, split=split)
    if name == "local":
        raise ValueError("Data set 'local' needs `data_files`: the local JSON / JSONL / Parquet / CSV files to read.")
    if os.path.isfile(source.hub_id):
        return load_local_files(source.hub_id, split=split)
    try:
        return load_dataset(source.hub_id, source.config, split=split)
    except ConnectionError as err:  # offline (HF_HUB_OFFLINE=1, huggingface_hub's OfflineModeIsEnabled) or no network
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0")
        raise FileNotFoundError(
            f"Data set {source.hub_id!r} is not in the local datasets cache, and the hub cannot be reached "
            f"({'HF_HUB_OFFLINE is set: ' if offline else ''}{err}). Download it once with network access"
            f"{' and HF_HUB_OFFLINE unset' if offline else ''} (`datasets.load_dataset({source.hub_id!r}, "
            f"{source.config!r}, split={split!r})`), or give local files with the same columns in dataset_files."
        ) from None


def _deduplicate(problems: list[str]) -> list[int]:
    """Indices of the first occurrence of every distinct problem, in order."""
    seen: set[str] = set()
    keep = []
    for i, problem in enumerate(problems):
        if problem not in seen:
            seen.add(problem)
            keep.append(i)
    return keep


def load_math_dataset(
    name: str = "dapo-math-17k",
    *,
    template: str,
    split: str = "train",
    config: str | None = None,
    data_files: Sequence[str] | None = None,
    problem_column: str | None = None,
    answer_column: str | None = None,
    answer_format: str | None = None,
    deduplicate: bool | None = None,
    max_samples: int | None = None,
):
    """Load a math data set as TRL conversational prompts (`prompt`) with gold answers (`solution`), and its other
    columns, which TRL passes to the reward functions as keyword arguments.

    Args:
        name: a preset from `DATASET_PRESETS`, `"local"` (then `data_files` is required), any hub id, a local data
            set directory or a single local file.
        template: a prompt template name from `opefo_trl.data.prompts.PROMPT_TEMPLATES`.
        split: the split to load (for local files: the name given to them).
        config: the hub configuration, overriding the preset's.
        data_files: local JSON / JSONL / Parquet / CSV files read instead of downloading `name` (same columns).
        problem_column / answer_column: override the preset's columns; required for non-presets. Dotted names
            address fields of struct columns (`reward_model.ground_truth`). A problem column may hold text or a
            chat (the last user turn is the problem).
        answer_format: `"plain"`, `"boxed"` (last `\\boxed{}`) or `"gsm8k"` (after `####`); default: the preset's.
        deduplicate: keep the first row of every distinct problem; default: the preset's.
        max_samples: keep the first `max_samples` rows (after deduplication).

    Rows whose gold answer cannot be extracted are dropped with a warning that says how many; if none is left, or
    a column is missing, a ValueError says what is wrong.

    Example:
        >>> ds = load_math_dataset("math-lighteval", template="plain", data_files=["math.parquet"])  # doctest: +SKIP
        >>> ds[0]["solution"]  # doctest: +SKIP
        '\\\\frac{1}{2}'
    """
    from datasets import Dataset

    from opefo_trl.data.prompts import format_prompt, get_template

    source = resolve_dataset_source(
        name,
        config=config,
        problem_column=problem_column,
        answer_column=answer_column,
        answer_format=answer_format,
        deduplicate=deduplicate,
    )
    get_template(template)  # an unknown name is a ValueError listing the valid ones, before any loading
    check_config_for_files(config, data_files)
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"max_samples must be at least 1 (or None for all rows), got {max_samples}.")
    shown = name if not data_files else f"{name} ({', '.join(map(os.fspath, data_files))})"
    raw = _load_raw(source, name=name, split=split, data_files=data_files)
    _check_column(raw, source.problem_column, role="problem", option="problem_column", source=shown)
    _check_column(raw, source.answer_column, role="gold answer", option="answer_column", source=shown)

    top_columns = list(dict.fromkeys([source.problem_column.split(".")[0], source.answer_column.split(".")[0]]))
    extra_columns = _extra_columns(raw.column_names, top_columns, shown)
    full, raw = raw, raw.select_columns(top_columns)
    problems = _problem_texts(_column_values(raw, source.problem_column), source.problem_column)
    if source.unwrap_dapo_instruction:
        problems = [unwrap_dapo_instruction(p) for p in problems]
    keep = _deduplicate(problems) if source.deduplicate else list(range(len(problems)))
    if source.deduplicate:
        logger.info("Deduplicated %s: %d of %d rows kept.", shown, len(keep), len(problems))
    answer_values = _column_values(raw, source.answer_column)
    raw_answers = answer_values.to_pylist()
    if getattr(answer_values.type, "extension_name", None) == "arrow.json":  # values of mixed types, held as JSON text
        raw_answers = [None if v is None else json.loads(v) for v in raw_answers]
    extract = _ANSWER_EXTRACTORS[source.answer_format]

    prompts, solutions, rows, unanswerable = [], [], [], []
    for i in keep:
        _check_gold_type(raw_answers[i], row=i, column=source.answer_column, answer_format=source.answer_format)
        answer = extract(raw_answers[i])
        if answer is None or not problems[i]:
            unanswerable.append(i)
            continue
        prompts.append(format_prompt(problems[i], template))
        solutions.append(answer)
        rows.append(i)
        if max_samples is not None and len(prompts) >= max_samples:
            break
    if unanswerable:
        logger.warning(
            "Dropped %d row(s) of %s with an empty problem or no %s gold answer in column %r (first: row %d).",
            len(unanswerable),
            shown,
            source.answer_format,
            source.answer_column,
            unanswerable[0],
        )
    if not prompts:
        raise ValueError(
            f"No usable rows in {shown}: none of {len(keep)} rows has a problem and a {source.answer_format!r} "
            f"gold answer in column {source.answer_column!r}. Check `answer_column` and `answer_format`."
        )
    dataset = Dataset.from_dict({"prompt": prompts, "solution": solutions})
    if extra_columns:  # TRL passes every column but the prompt to the reward functions, as keyword arguments
        from datasets import concatenate_datasets

        dataset = concatenate_datasets([dataset, full.select(rows).select_columns(extra_columns)], axis=1)
    return dataset


#: Keyword arguments TRL gives reward functions itself: a data column of one of these names would clash with it.
REWARD_KWARGS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments")


def _extra_columns(columns: Sequence[str], used: Sequence[str], shown: str) -> list[str]:
    """The data set's columns besides the problem and the answer, kept for the reward functions; those whose names
    the training data or TRL's reward arguments take are dropped, with a warning naming them."""
    taken = {"prompt", "solution", *REWARD_KWARGS}
    extra = [c for c in columns if c not in used]
    dropped = [c for c in extra if c in taken]
    if dropped:
        logger.warning(
            "Column(s) %s of %s are not passed to the reward functions: the prompt, the gold answer (solution) and "
            "TRL's own reward arguments take those names. Rename them to pass them.",
            ", ".join(dropped),
            shown,
        )
    return [c for c in extra if c not in taken]


def prompt_token_lengths(dataset, tokenizer, *, chat_template_kwargs: dict | None = None, batch_size: int = 1000):
    """Token count of every `prompt`, rendered as GRPOTrainer renders it (`opefo_trl.data.prompts.render_prompts`)."""
    lengths: list[int] = []
    prompts = dataset["prompt"]
    for start in range(0, len(dataset), batch_size):
        batch = prompts[start : start + batch_size]
        lengths.extend(len(ids) for ids in render_prompts(tokenizer, batch, chat_template_kwargs=chat_template_kwargs))
    return lengths


def check_prompt_lengths(
    dataset,
    tokenizer,
    *,
    max_completion_length: int,
    max_position_embeddings: int,
    drop_overlong: bool = False,
    chat_template_kwargs: dict | None = None,
):
    """Make sure every prompt plus `max_completion_length` fits the model's context; return the (filtered) data set.

    A prompt longer than ``max_position_embeddings - max_completion_length`` tokens would be truncated or overflow
    the position embeddings mid-rollout, so it is an error before training unless ``drop_overlong`` is set, in
    which case such rows are dropped with a warning (and it is still an error if nothing is left).

        >>> check_prompt_lengths(ds, tok, max_completion_length=3000, max_position_embeddings=4096)  # doctest: +SKIP
    """
    if max_completion_length >= max_position_embeddings:
        raise ValueError(
            f"max_completion_length ({max_completion_length}) leaves no room for the prompt in the model's context "
            f"of {max_position_embeddings} tokens (max_position_embeddings). Lower max_completion_length."
        )
    budget = max_position_embeddings - max_completion_length
    lengths = prompt_token_lengths(dataset, tokenizer, chat_template_kwargs=chat_template_kwargs)
    overlong = [i for i, n in enumerate(lengths) if n > budget]
    if not overlong:
        return dataset
    longest = max(lengths)
    detail = (
        f"{len(overlong)} of {len(lengths)} prompts are longer than {budget} tokens (longest: {longest} tokens, "
        f"row {lengths.index(longest)}): prompt + max_completion_length ({max_completion_length}) must fit the "
        f"model's context of {max_position_embeddings} tokens (max_position_embeddings)"
    )
    if not drop_overlong:
        raise ValueError(f"{detail}. Lower max_completion_length, or set drop_overlong_prompts to drop those prompts.")
    if len(overlong) == len(lengths):
        raise ValueError(f"{detail}; dropping them would leave no data. Lower max_completion_length.")
    logger.warning("%s; dropping them (drop_overlong_prompts).", detail)
    overlong_set = set(overlong)
    return dataset.select([i for i in range(len(lengths)) if i not in overlong_set])
