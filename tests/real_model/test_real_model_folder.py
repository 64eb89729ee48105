"""The folder opefo_trl.real_model.smollm2_135m_instruct() yields: a plain SmolLM2-135M-Instruct that loads by path,
with its chat template, pad = eos, and the record of its logits check against the GGUF-loaded model."""

import hashlib
import json
import pathlib

import pytest

from opefo_trl import real_model
from opefo_trl.real_model import GGUF_SHA256, LOGITS_TOLERANCE, MARKER, folder_problem, smollm2_135m_instruct

pytestmark = pytest.mark.real_model


def test_the_folder_is_a_plain_llama_with_its_chat_template_and_its_logits_check(real_model_path):
    from transformers import AutoConfig, AutoTokenizer

    from opefo_trl.data.model_files import check_model_name_or_path

    check_model_name_or_path(real_model_path)  # what opefo-train and opefo-eval accept
    config = AutoConfig.from_pretrained(real_model_path)
    assert config.model_type == "llama" and getattr(config, "quantization_config", None) is None
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.vocab_size) == (
        30,
        576,
        9,
        49152,
    )
    assert config.tie_word_embeddings
    tokenizer = AutoTokenizer.from_pretrained(real_model_path)
    assert tokenizer.pad_token == tokenizer.eos_token == "<|im_end|>"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")

    record = json.loads((pathlib.Path(real_model_path) / MARKER).read_text())
    assert record["gguf_sha256"] == GGUF_SHA256
    assert record["max_abs_logit_difference"] <= LOGITS_TOLERANCE * record["max_abs_logit"]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(record["files"])
    assert smollm2_135m_instruct() == pathlib.Path(real_model_path)  # cached: returned at once


def test_a_build_records_its_files_and_50_mb_zeroed_in_the_weights_are_found(tmp_path):
    """One real build, into a cache of its own: the marker records every file's size and sha256; 50 MB zeroed inside
    model.safetensors (what the issue's probe did, and opefo-eval then scored) are found, where the folder used to be
    returned as it was. (Rebuilding what is found: tests/test_real_model.py, on a stand-in build.)"""
    folder = smollm2_135m_instruct(tmp_path)
    files = json.loads((folder / MARKER).read_text())["files"]
    assert set(files) == {p.name for p in folder.iterdir()} - {MARKER}
    for name, record in files.items():
        content = (folder / name).read_bytes()
        assert record == {"size": len(content), "sha256": hashlib.sha256(content).hexdigest()}
    real_model._verified.clear()  # as in a new process: hashed again
    assert folder_problem(folder) is None
    with open(folder / "model.safetensors", "r+b") as f:
        f.seek(100 << 20)
        f.write(bytes(50 << 20))
    assert folder_problem(folder) == (
        "has a model.safetensors that is not the one built (its sha256 differs from the one recorded then)"
    )
