"""opefo_trl.data.model_files: model paths, weight fingerprints and the context length."""

import json
import os
import re

import pytest

from opefo_trl.data.model_files import check_model_name_or_path, model_context_length, weight_fingerprints

# ----------------------------------------------------------------------------------------------------------------------
# Context length
# ----------------------------------------------------------------------------------------------------------------------


def test_context_length_from_a_path_a_config_and_vllm(tiny_model_path):
    from transformers import AutoConfig, LlavaConfig, PretrainedConfig, Qwen2Config

    assert model_context_length(tiny_model_path) == AutoConfig.from_pretrained(tiny_model_path).max_position_embeddings
    assert model_context_length(tiny_model_path) == 1024
    assert model_context_length(tiny_model_path, max_model_len=512) == 512  # vLLM's limit caps it
    assert model_context_length(tiny_model_path, max_model_len=4096) == 1024  # never raises it
    assert model_context_length(tiny_model_path, context_length=8192) == 8192  # the caller's word, config unread
    assert model_context_length("/no/such/model", context_length=300, max_model_len=200) == 200
    nested = LlavaConfig(text_config=Qwen2Config(max_position_embeddings=2048).to_dict())
    assert model_context_length(nested) == 2048  # a multimodal config's text model
    assert model_context_length(PretrainedConfig()) is None  # a config without max_position_embeddings
    with pytest.raises(OSError):
        model_context_length("/no/such/model")


def test_model_paths_are_checked_without_loading(tiny_model_path, tmp_path):
    check_model_name_or_path(tiny_model_path)
    check_model_name_or_path("Qwen/Qwen2.5-Math-7B")  # a hub id: left to the hub (or its cache)
    with pytest.raises(FileNotFoundError, match=r"Model path '\./runs/nope' does not exist. Give a local model"):
        check_model_name_or_path("./runs/nope")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        check_model_name_or_path(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")  # a config without weights: opefo-train would fail loading it
    with pytest.raises(FileNotFoundError, match=r"holds no weights \(no \*.safetensors, pytorch_model\*.bin or shard"):
        check_model_name_or_path(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="is a file; give the model's directory"):
        check_model_name_or_path(str(tmp_path / "weights.bin"))
    with pytest.raises(ValueError, match="'bad name' is neither a local directory nor a valid hub id"):
        check_model_name_or_path("bad name")


def test_model_file_fingerprints_follow_the_tokenizer_template_and_configs(tiny_model_path, tmp_path):
    import shutil

    from opefo_trl.data.model_files import model_file_fingerprints

    model = tmp_path / "model"
    shutil.copytree(tiny_model_path, model)
    prints = model_file_fingerprints(model)
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(prints)
    assert "model.safetensors" not in prints  # weights: weight_fingerprints
    (model / "additional_chat_templates").mkdir()
    (model / "additional_chat_templates" / "tools.jinja").write_text("{{ messages }}")
    again = model_file_fingerprints(model)
    assert again["additional_chat_templates/tools.jinja"] and {k: again[k] for k in prints} == prints


# ----------------------------------------------------------------------------------------------------------------------
# Weight fingerprints
# ----------------------------------------------------------------------------------------------------------------------


def _tensor_offset(path, name: str) -> int:
    """Where the data of tensor ``name`` starts in a safetensors file (8-byte header length, JSON header, data)."""
    with open(path, "rb") as f:
        header_length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_length))
    return 8 + header_length + header[name]["data_offsets"][0]


def test_weight_fingerprints_follow_every_byte_whatever_the_mtime(tmp_path):
    """Training or an edit that changes one row no sample of the file reads (here row 1 of 50, neither the first,
    the middle nor the last), even in place with the mtime put back, gives samples drawn from other weights."""
    import shutil

    import torch
    from safetensors.torch import save_file

    tensors = {"embed": torch.randn(50, 8), "norm": torch.ones(8), "half": torch.randn(3, 4).to(torch.bfloat16)}
    path = tmp_path / "model.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    first = weight_fingerprints(tmp_path)
    assert set(first) == {"model.safetensors"} and first["model.safetensors"].startswith("xxh3:")
    (tmp_path / "other.txt").write_text("not weights")
    assert weight_fingerprints(tmp_path) == first  # weight files only
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(path, copy / "model.safetensors")  # a copy has another mtime, the same content
    assert weight_fingerprints(copy) == first

    changed = {k: v.clone() for k, v in tensors.items()}
    changed["embed"][1, 3] += 1
    save_file(changed, path, metadata={"format": "pt"})
    assert weight_fingerprints(tmp_path) != first
    save_file(tensors, path, metadata={"format": "pt"})
    assert weight_fingerprints(tmp_path) == first

    stat = os.stat(path)
    offset = _tensor_offset(path, "embed") + 1 * 8 * 4 + 3 * 4  # row 1, column 3, float32
    with open(path, "r+b") as f:  # in place: same size, same inode
        f.seek(offset)
        value = f.read(4)
        f.seek(offset)
        f.write(bytes([value[0] ^ 1]) + value[1:])
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert os.stat(path).st_size == stat.st_size and os.stat(path).st_mtime_ns == stat.st_mtime_ns
    assert weight_fingerprints(tmp_path) != first


def _misconfigured_copy(model, folder, edit):
    """A copy of the model folder ``model`` whose config.json is ``edit(settings)`` written as JSON."""
    import shutil

    shutil.copytree(model, folder)
    with open(os.path.join(folder, "config.json")) as f:
        settings = json.load(f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(edit(settings), f)
    return str(folder)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda s: [s], "config.json holds a JSON list, not a mapping of the model's settings: it is not a file"),
        (lambda s: "qwen2", "config.json holds a JSON string, not a mapping of the model's settings"),
        (
            lambda s: {**s, "vocab_size": s["vocab_size"] + 64},
            "config.json says vocab_size=384, but the model.embed_tokens.weight of model.safetensors has 320 rows",
        ),
        (
            lambda s: {**s, "tie_word_embeddings": False},  # then lm_head.weight must be stored: it is not compared
            None,
        ),
    ],
    ids=["list", "string", "vocab_size", "untied"],
)
def test_check_model_config_refuses_a_config_that_is_not_the_weights(edit, message, tiny_model_path, tmp_path):
    """S: transformers' TypeError ("argument after ** must be a mapping") or "mismatched sizes" RuntimeError."""
    from opefo_trl.data.model_files import check_model_config

    model = _misconfigured_copy(tiny_model_path, tmp_path / "model", edit)
    if message is None:
        check_model_config(model)
        return
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        check_model_config(model)
    assert "restore the config.json saved with these weights" in str(err.value).lower()


def test_check_model_config_compares_an_untied_output_head(tiny_model_path, tmp_path):
    """An untied head (``lm_head.weight`` stored) is compared as the input embedding is."""
    import torch
    from safetensors.torch import load_file, save_file

    from opefo_trl.data.model_files import check_model_config

    model = _misconfigured_copy(tiny_model_path, tmp_path / "model", lambda s: {**s, "tie_word_embeddings": False})
    weights = load_file(os.path.join(model, "model.safetensors"))
    weights["lm_head.weight"] = torch.zeros(256, weights["model.embed_tokens.weight"].shape[1])
    save_file(weights, os.path.join(model, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=re.escape("the lm_head.weight of model.safetensors has 256 rows")):
        check_model_config(model)
