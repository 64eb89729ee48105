"""opefo_trl.data.model_files: model paths, weight fingerprints and the context length."""

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


def test_weight_fingerprints_follow_every_tensor_and_survive_a_damaged_file(tmp_path):
    import torch
    from safetensors.torch import save_file

    tensors = {
        "embed": torch.randn(50, 8),
        "norm": torch.ones(8),
        "scale": torch.tensor(2.0),
        "half": torch.randn(3, 4),
    }
    tensors["half"] = tensors["half"].to(torch.bfloat16)  # bytes, not numpy: bf16 has no numpy dtype
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    first = weight_fingerprints(tmp_path)
    assert set(first) == {"model.safetensors"}
    (tmp_path / "other.txt").write_text("not weights")
    assert weight_fingerprints(tmp_path) == first  # content only: other files and mtimes do not count
    for name, change in (("embed", (25, 3)), ("norm", (7,)), ("scale", ()), ("half", (2, 0))):
        changed = {k: v.clone() for k, v in tensors.items()}
        changed[name][change] += 1  # one element of the middle or last row, or a scalar
        save_file(changed, tmp_path / "model.safetensors", metadata={"format": "pt"})
        assert weight_fingerprints(tmp_path) != first, name
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert weight_fingerprints(tmp_path) == first
    # a header safetensors cannot read: fingerprinted as bytes, not an error
    (tmp_path / "model.safetensors").write_bytes(b"\x10" + b"\x00" * 7 + b"{garbage}       " + b"x" * 100)
    damaged = weight_fingerprints(tmp_path)
    assert damaged["model.safetensors"] != first["model.safetensors"] and len(damaged["model.safetensors"]) == 32
