"""What goes into a model and what comes out, handled one way for training, evaluation and the demo.

- Local data files: :func:`local_file_builder` checks JSON / JSONL / Parquet / CSV files and names the `datasets`
  builder that reads them; :func:`load_local_files` loads them.
- Model paths and weights: :func:`check_model_name_or_path` refuses a model that is neither a local model directory
  nor a valid hub id; :func:`weight_fingerprints` identifies the weights in a directory by content (``opefo-eval``
  refuses samples drawn from other weights).
- Context length: :func:`model_context_length`, the number of tokens prompt + completion must fit (the model
  config's ``max_position_embeddings``, capped by vLLM's ``max_model_len`` when vLLM generates).
- Prompts: :func:`render_prompts` turns TRL prompts (chats or plain strings) into token ids exactly as
  ``GRPOTrainer`` tokenizes them before generating, so ``opefo-train``'s length check, ``opefo-eval`` and the demo
  see the very prompt the policy sees.
- Completions: :func:`completion_to_text` turns a TRL completion back into the text a reward function scores.

Example:
    >>> completion_to_text([{"role": "assistant", "content": "3 + 4"}])
    '3 + 4'
    >>> model_context_length(None, context_length=4096, max_model_len=2048)
    2048
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from typing import Any

LOCAL_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
"""File extension -> `datasets` builder of the local data files every loader accepts."""


# ----------------------------------------------------------------------------------------------------------------------
# Local data files
# ----------------------------------------------------------------------------------------------------------------------


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
    if len(builders) > 1:
        raise ValueError(f"All data files must have one format, got a mix of {sorted(builders)}: {files}.")
    return builders.pop()


def _is_blank(path: str, chunk_size: int = 1 << 16) -> bool:
    """Whether a file holds nothing but whitespace (read up to its first other byte)."""
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            if chunk.strip():
                return False
    return True


def load_local_files(data_files: str | os.PathLike | Sequence[str | os.PathLike], split: str = "train"):
    """Load local JSON / JSONL / Parquet / CSV files (one format) as one `datasets.Dataset` named ``split``."""
    from datasets import load_dataset

    builder = local_file_builder(data_files)
    return load_dataset(builder, data_files={split: _as_file_list(data_files)}, split=split)


# ----------------------------------------------------------------------------------------------------------------------
# Model paths
# ----------------------------------------------------------------------------------------------------------------------


def looks_like_local_path(name: str) -> bool:
    """Whether a model name can only be a local path: absolute, relative (``./``, ``~``) or nested below ``a/b``.

    >>> looks_like_local_path("runs/opefo/checkpoint-50"), looks_like_local_path("Qwen/Qwen2.5-Math-7B")
    (True, False)
    """
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or os.sep == "\\" and "\\" in name


def check_model_name_or_path(name: str) -> None:
    """Refuse, without loading anything, a model that is neither a local model directory nor a valid hub id.

    >>> check_model_name_or_path("./no-such-model")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    FileNotFoundError: Model path './no-such-model' does not exist. Give a local model directory or a hub id ...
    """
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"Model directory {name!r} has no config.json; give a saved model's directory.")
        return
    if os.path.exists(path):
        raise ValueError(f"Model path {name!r} is a file; give the model's directory.")
    if looks_like_local_path(name):
        raise FileNotFoundError(
            f"Model path {name!r} does not exist. Give a local model directory or a hub id such as "
            "'Qwen/Qwen2.5-Math-7B'."
        )
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError as err:
        raise ValueError(f"Model {name!r} is neither a local directory nor a valid hub id ({err})") from None


_WEIGHT_FILE_RE = re.compile(r"(\.safetensors|^(pytorch_model|adapter_model)(-\d+-of-\d+)?\.bin)$")
_BLOCK = 4096


def _safetensors_digest(f, digest) -> None:
    """Header, then the first, middle and last 4 KiB of every tensor: any trained tensor changes them."""
    header_size = int.from_bytes(f.read(8), "little")
    header = f.read(header_size)
    digest.update(header)
    tensors = json.loads(header)
    start = 8 + header_size
    offsets = sorted(t["data_offsets"] for name, t in tensors.items() if name != "__metadata__")
    for begin, end in ((start + b, start + e) for b, e in offsets):
        for offset in sorted({begin, max(begin, (begin + end) // 2 - _BLOCK // 2), max(begin, end - _BLOCK)}):
            f.seek(offset)
            digest.update(f.read(min(_BLOCK, end - offset)))


def weight_file_fingerprint(path: str | os.PathLike) -> str:
    """A content fingerprint of a weight file read in small pieces (no mtime: a copy keeps it, training changes it).

    safetensors: the header and three 4 KiB blocks of every tensor; other files: 64 blocks of 64 KiB spread over
    the file. Both with the file size. Training moves every trainable tensor, hence its sampled blocks.
    """
    size = os.path.getsize(path)
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if os.fspath(path).endswith(".safetensors"):
            try:
                _safetensors_digest(f, digest)
                return digest.hexdigest()[:32]
            except (ValueError, KeyError, TypeError):  # not a readable header: fingerprint it as bytes
                digest = hashlib.sha256(str(size).encode())
        block = 1 << 16
        for offset in sorted({min(i * size // 64, max(0, size - block)) for i in range(64)}):
            f.seek(offset)
            digest.update(f.read(block))
    return digest.hexdigest()[:32]


def weight_fingerprints(directory: str | os.PathLike) -> dict[str, str]:
    """``{file name: weight_file_fingerprint}`` of the weight files of a model or adapter directory.

    >>> weight_fingerprints("/no/such/model")
    {}
    """
    if not os.path.isdir(directory):
        return {}
    return {
        name: weight_file_fingerprint(os.path.join(directory, name))
        for name in sorted(os.listdir(directory))
        if _WEIGHT_FILE_RE.search(name) and os.path.isfile(os.path.join(directory, name))
    }


# ----------------------------------------------------------------------------------------------------------------------
# Context length
# ----------------------------------------------------------------------------------------------------------------------


def model_context_length(
    model: Any,
    *,
    context_length: int | None = None,
    max_model_len: int | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
) -> int | None:
    """The tokens prompt + completion must fit; ``None`` when nothing says.

    Args:
        model: A model path or hub id (its config is read, no weights), or a loaded `PretrainedConfig`.
        context_length: The context when the caller knows it (e.g. ``--context_length``): the config is not read.
        max_model_len: vLLM's ``max_model_len`` when vLLM generates: the context is capped by it.
        revision, trust_remote_code: Passed to ``AutoConfig.from_pretrained``.

    The model's own context is ``max_position_embeddings`` of its text config (multimodal configs nest it).

    Example:
        >>> from transformers import Qwen2Config
        >>> model_context_length(Qwen2Config(max_position_embeddings=4096)), model_context_length(None)
        (4096, None)
        >>> model_context_length(Qwen2Config(max_position_embeddings=4096), max_model_len=2048)
        2048
    """
    if context_length is None and model is not None:
        from transformers import AutoConfig, PretrainedConfig

        config = model
        if not isinstance(config, PretrainedConfig):
            config = AutoConfig.from_pretrained(model, revision=revision, trust_remote_code=trust_remote_code)
        value = getattr(config.get_text_config(), "max_position_embeddings", None)
        context_length = value if isinstance(value, int) and value > 0 else None
    if max_model_len is not None:
        context_length = max_model_len if context_length is None else min(context_length, max_model_len)
    return context_length


# ----------------------------------------------------------------------------------------------------------------------
# Prompts and completions
# ----------------------------------------------------------------------------------------------------------------------


def render_prompts(tokenizer, prompts: Sequence, *, chat_template_kwargs: dict | None = None) -> list[list[int]]:
    """Token ids of TRL prompts, as ``GRPOTrainer`` tokenizes them for generation.

    Conversational prompts (lists of ``{"role", "content"}`` messages) go through the tokenizer's chat template with
    the generation prompt appended (the assistant header the completion follows); plain-text prompts are tokenized
    as they are, special tokens included.

    Raises:
        ValueError: conversational prompts but the tokenizer has no chat template, or a mix of both kinds.
    """
    from trl.data_utils import is_conversational

    prompts = list(prompts)
    if not prompts:
        return []
    conversational = [is_conversational({"prompt": prompt}) for prompt in prompts]
    if any(conversational) and not all(conversational):
        other = conversational.index(not conversational[0])
        raise ValueError(
            f"Prompts mix chats and plain text (prompt 0 is {'a chat' if conversational[0] else 'text'}, prompt "
            f"{other} is not); give every prompt in one form."
        )
    if not conversational[0]:
        return [list(ids) for ids in tokenizer(text=prompts)["input_ids"]]
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"The tokenizer of {getattr(tokenizer, 'name_or_path', None) or 'the model'} has no chat template, which "
            "conversational prompts need; use a tokenizer that has one (e.g. the instruct model's)."
        )
    encoded = tokenizer.apply_chat_template(
        conversation=prompts,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        **(chat_template_kwargs or {}),
    )
    return [list(ids) for ids in encoded["input_ids"]]


def _content_text(content: Any) -> str | None:
    """A message's content as text: a string, or the text parts of a multimodal content list joined."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, (list, tuple)):
        return "".join(part.get("text") or "" for part in content if isinstance(part, dict))
    return None


def completion_to_text(completion: Any) -> str:
    """The text of a TRL completion that a reward scores: a plain string as it is, or for a conversational completion
    the content of its last assistant message.

    ``GRPOTrainer`` passes conversational completions as ``[{"role": "assistant", "content": text}]``; with tool
    calling a completion holds the whole exchange (``assistant``, ``tool``, ..., ``assistant``) and its final answer
    is the last assistant turn, so tool outputs and earlier turns are never scored. A message without a ``role``
    counts as the assistant's; content given as a list of parts (``[{"type": "text", "text": ...}]``) is joined.

    Raises:
        TypeError: anything else (the message shows what was given).

    Example:
        >>> completion_to_text("Answer: 42")
        'Answer: 42'
        >>> completion_to_text([{"role": "assistant", "content": "Let me add.", "tool_calls": ["..."]},
        ...                     {"role": "tool", "name": "add", "content": "41"},
        ...                     {"role": "assistant", "content": [{"type": "text", "text": "Answer: 42"}]}])
        'Answer: 42'
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    if isinstance(completion, (list, tuple)) and completion and all(isinstance(m, dict) for m in completion):
        assistant = [m for m in completion if m.get("role", "assistant") == "assistant"]
        text = _content_text(assistant[-1].get("content")) if assistant else None
        if text is not None:
            return text
    raise TypeError(
        "Expected a completion as a string or a list of chat messages ending in an assistant turn "
        f"([{{'role': 'assistant', 'content': ...}}]), got {completion!r:.200}."
    )
