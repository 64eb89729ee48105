"""The folder opefo_trl.real_model.smollm2_135m_instruct() yields: a plain SmolLM2-135M-Instruct that loads by path,
with its chat template, pad = eos, and the record of its logits check against the GGUF-loaded model."""

import json
import pathlib

import pytest

from opefo_trl.real_model import GGUF_SHA256, LOGITS_TOLERANCE, MARKER, smollm2_135m_instruct

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
    assert smollm2_135m_instruct() == pathlib.Path(real_model_path)  # cached: returned at once
