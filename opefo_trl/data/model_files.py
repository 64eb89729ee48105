"""A model given by name, checked before anything loads: its path, its weight files and its context length.

Shared by ``opefo-train``, ``opefo-eval`` and the demo:

- Model paths: :func:`check_model_name_or_path` refuses a model that is neither a local model directory (with its
  weights and tokenizer files) nor a valid hub id; :func:`check_model_config` a local model whose ``config.json`` is
  not a mapping of settings, or does not fit its weights (``vocab_size``).
- Model files: :func:`weight_fingerprints` identifies the weights in a directory by every byte, and
  :func:`model_file_fingerprints` the files that decide how prompts are rendered and completions generated (the
  tokenizer, chat template, config and generation config); ``opefo-eval`` refuses samples drawn with other ones.
- Context length: :func:`model_context_length`, the number of tokens prompt + completion must fit (the model
  config's ``max_position_embeddings``, capped by vLLM's ``max_model_len`` when vLLM generates).

Example:
    >>> model_context_length(None, context_length=4096, max_model_len=2048)
    2048
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Iterable, Sequence
from typing import Any

logger = logging.getLogger(__name__)


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
        check_has_weights(path)
        check_has_tokenizer(path)
        check_model_config(path)
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


def read_json_mapping(path: str | os.PathLike, what: str) -> dict[str, Any]:
    """The JSON object in ``path``, ``what`` a model file holds (e.g. "the model's settings"); refused, saying how to
    fix it, if the file is not valid JSON or holds another JSON value (a list, a string).

    >>> import tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "config.json")
    >>> _ = open(path, "w").write('[{"model_type": "qwen2"}]')
    >>> read_json_mapping(path, "the model's settings")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: .../config.json holds a JSON list, not a mapping of the model's settings: ...
    """
    try:
        with open(path, encoding="utf-8") as f:
            content = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        problem = f"is not valid JSON ({err})"
    else:
        if isinstance(content, dict):
            return content
        kinds = {list: "list", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}
        problem = f"holds a JSON {kinds.get(type(content), type(content).__name__)}, not a mapping of {what}"
    raise ValueError(
        f"{os.fspath(path)} {problem}: it is not a file transformers can read. Restore the {os.path.basename(path)} "
        "saved with these weights (e.g. from the checkpoint or base model the folder was copied from)."
    )


def check_model_config(directory: str | os.PathLike) -> None:
    """Refuse, before any weights load, a local model directory whose ``config.json`` is not a JSON mapping, or whose
    ``vocab_size`` (or embedding shape) disagrees with the embedding matrices in its safetensors files: loading would
    stop with a traceback (a TypeError, or transformers' "mismatched sizes" RuntimeError after reading every weight).

    Only the safetensors headers are read, and the model is built on the meta device (no memory, no weights) to learn
    its embeddings' names and shapes. A config transformers cannot build a model from (remote code, a model type this
    transformers lacks) is not compared: loading reports it.
    """
    settings = read_json_mapping(os.path.join(directory, "config.json"), "the model's settings")
    stored = safetensors_shapes(directory)
    if not stored:
        return
    expected = _embedding_shapes(directory)
    for name, shape in expected.items():
        found = stored.get(name)
        if found is None or tuple(found[1]) == shape:
            continue
        file, found_shape = found
        text_settings = settings.get("text_config")  # multimodal configs nest the text model's
        vocab_size = settings.get(
            "vocab_size", text_settings.get("vocab_size") if isinstance(text_settings, dict) else None
        )
        if found_shape[0] != shape[0]:
            fix = (
                f"config.json says vocab_size={vocab_size}, but the {name} of {file} has {found_shape[0]} rows (one "
                f"per token): the config does not belong to these weights. Set vocab_size to {found_shape[0]}"
            )
        else:
            fix = (
                f"the config gives {name} the shape {list(shape)}, but {file} holds {list(found_shape)}: the config "
                "does not belong to these weights. Fix the sizes in config.json"
            )
        raise ValueError(
            f"Model directory {os.fspath(directory)}: {fix}, or restore the config.json saved with these weights."
        )


def safetensors_problem(path: str | os.PathLike) -> str | None:
    """Why safetensors cannot read the file whole (it checks the header, and that the data covers the file to its
    end), read without loading a tensor; None if it can."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(os.fspath(path), framework="numpy") as f:
            f.keys()
    except SafetensorError as err:
        return f"cannot be read by safetensors (cut short or damaged: {err})"
    return None


def safetensors_shapes(directory: str | os.PathLike) -> dict[str, tuple[str, list[int]]]:
    """``{tensor name: (file name, shape)}`` of the ``*.safetensors`` files of ``directory``, from their headers.

    Raises:
        ValueError: a file safetensors cannot read whole (:func:`safetensors_problem`: what an interrupted copy or
            save leaves), named with its size.
    """
    from safetensors import safe_open

    shapes: dict[str, tuple[str, list[int]]] = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            path = os.path.join(directory, name)
            problem = safetensors_problem(path)
            if problem is not None:
                raise ValueError(
                    f"{path} ({os.path.getsize(path)} bytes) {problem}: the weights are not whole, as an interrupted "
                    "copy or save leaves them. Copy that file again from where it came from (or save the model "
                    "again), or give another model."
                )
            with safe_open(path, framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                    shapes[key] = (name, list(f.get_slice(key).get_shape()))
    return shapes


def _embedding_shapes(directory: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """``{parameter name: shape}`` of the input and output embeddings of the model ``directory``'s config builds (on
    the meta device); empty if transformers cannot build it from the config alone."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(directory)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as err:  # the check is a shortcut: loading reports what keeps a model from being built
        logger.debug("No embedding check for %s: %s", directory, err)
        return {}
    embeddings = [getattr(m, "weight", None) for m in (model.get_input_embeddings(), model.get_output_embeddings())]
    return {
        name: tuple(param.shape)
        for name, param in model.named_parameters(remove_duplicate=False)  # a tied head under both names
        if any(param is weight for weight in embeddings if weight is not None)
    }


def non_finite_names(tensors: Iterable[tuple[str, Any]]) -> list[str]:
    """The names of the floating-point tensors of ``(name, tensor)`` pairs that hold NaN or inf, each checked as it
    comes (a generator that reads one tensor at a time keeps one in memory). What ``opefo-eval`` checks a model's
    weight files with, and ``OPEFOTrainer`` the policy it loaded.

    >>> import torch
    >>> non_finite_names([("a", torch.ones(2)), ("b", torch.tensor([1.0, float("nan")])), ("c", torch.arange(2))])
    ['b']
    """
    import torch

    return [name for name, tensor in tensors if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())]


def non_finite_weights(where: str, names: Sequence[str], count: int | None = None) -> str:
    """How a model whose weights hold NaN or inf is named: ``where`` the weights come from, ``names`` the tensors
    (:func:`non_finite_names`), ``count`` their number if some were found elsewhere (other processes' shards).

    >>> non_finite_weights("runs/x", ["a", "b", "c", "d"])
    'The weights of runs/x hold NaN or inf (4 tensor(s): a, b, c and 1 more)'
    """
    count = len(names) if count is None else count
    shown = ", ".join(names[:3]) + (f" and {count - min(len(names), 3)} more" if count > 3 else "")
    return f"The weights of {where} hold NaN or inf ({count} tensor(s): {shown if names else 'on other processes'})"


_WEIGHT_FILE_RE = re.compile(r"(\.safetensors|^(pytorch_model|adapter_model)(-\d+-of-\d+)?\.bin)$")
#: Besides the weights, what decides what a model generates from a prompt: how the prompt is rendered (the chat
#: template) and tokenised, how completions are decoded and when they stop (the config, the generation config).
MODEL_TEXT_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
    "adapter_config.json",
)
#: Folder of the named chat templates a tokenizer may carry besides its default one.
CHAT_TEMPLATES_DIR = "additional_chat_templates"


def has_weight_files(directory: str | os.PathLike) -> bool:
    """Whether a model or adapter directory holds weight files (safetensors, ``*.bin`` or their shard index)."""
    return any(
        _WEIGHT_FILE_RE.search(name) or name.endswith((".safetensors.index.json", ".bin.index.json"))
        for name in os.listdir(directory)
    )


def check_has_weights(directory: str | os.PathLike) -> None:
    """Refuse a model or adapter directory without weights, which loading would report with a traceback.

    >>> import tempfile
    >>> check_has_weights(tempfile.mkdtemp())  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    FileNotFoundError: ... holds no weights (no *.safetensors, pytorch_model*.bin or shard index): ...
    """
    if not has_weight_files(directory):
        raise FileNotFoundError(
            f"{os.fspath(directory)} holds no weights (no *.safetensors, pytorch_model*.bin or shard index): it is "
            "not a whole saved model. Give a folder with its weights, e.g. a run's output_dir once training has "
            "finished, or one of its checkpoint-<step> folders."
        )


#: The files a tokenizer is built from: one of them must be there (the rest, tokenizer_config.json etc., refine it).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")


def check_has_tokenizer(directory: str | os.PathLike) -> None:
    """Refuse a local model directory without tokenizer files, which loading reports only after the weights.

    >>> import tempfile
    >>> check_has_tokenizer(tempfile.mkdtemp())  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    FileNotFoundError: ... has no tokenizer files (none of tokenizer.json, tokenizer.model, ...
    """
    if not any(os.path.isfile(os.path.join(directory, name)) for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"Model directory {os.fspath(directory)} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}): "
            "it is not a whole saved model (a run killed while saving its final model leaves one like this). Give "
            "a folder with its tokenizer, e.g. the run's last checkpoint-<step> folder, or copy the base model's "
            "tokenizer files into it."
        )


#: Bytes read per update of a weight file's hash.
_HASH_BLOCK = 1 << 22


def weight_file_fingerprint(path: str | os.PathLike) -> str:
    """A hash of every byte of a weight file: a change anywhere in it (a row no sample of the file would read, an
    edit in place that kept the mtime) changes it, and a copy keeps it. xxh3-128, not a cryptographic hash: it
    guards against accidents, and hashes a GB in the page cache in 0.3-0.7 s where sha256 takes 1.3-3 s (measured on
    a busy 2-core machine).

    >>> import tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> _ = open(path, "wb").write(b"weights")
    >>> weight_file_fingerprint(path)
    'xxh3:bdbda1eb6e05adc4800d98e5524fefbc'
    """
    import xxhash

    digest, block = xxhash.xxh3_128(), bytearray(_HASH_BLOCK)
    view = memoryview(block)
    with open(path, "rb", buffering=0) as f:
        while size := f.readinto(block):  # into one buffer: no copy per block
            digest.update(view[:size])
    return f"xxh3:{digest.hexdigest()}"


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


def model_file_fingerprints(directory: str | os.PathLike) -> dict[str, str]:
    """``{file name: sha256 prefix}`` of the :data:`MODEL_TEXT_FILES` of a model or adapter directory (and its
    ``additional_chat_templates/``): small files, hashed whole.

    >>> model_file_fingerprints("/no/such/model")
    {}
    """
    if not os.path.isdir(directory):
        return {}
    names = [name for name in MODEL_TEXT_FILES if os.path.isfile(os.path.join(directory, name))]
    templates = os.path.join(directory, CHAT_TEMPLATES_DIR)
    if os.path.isdir(templates):
        names += sorted(f"{CHAT_TEMPLATES_DIR}/{name}" for name in os.listdir(templates))
    prints = {}
    for name in names:
        with open(os.path.join(directory, name), "rb") as f:
            prints[name] = hashlib.sha256(f.read()).hexdigest()[:32]
    return prints


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
