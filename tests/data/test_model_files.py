"""opefo_trl.data.model_files: model paths, weight fingerprints and the context length."""

import pytest

from opefo_trl.data.model_files import check_model_name_or_path, model_context_length

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
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="is a file; give the model's directory"):
        check_model_name_or_path(str(tmp_path / "weights.bin"))
    with pytest.raises(ValueError, match="'bad name' is neither a local directory nor a valid hub id"):
        check_model_name_or_path("bad name")
