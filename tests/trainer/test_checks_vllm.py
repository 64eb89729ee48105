"""Refusals that need vLLM installed to decide (vLLM's CPU build; `make test-vllm`)."""

import os

import pytest

from opefo_trl import OPEFOConfig, OPEFOTrainer

pytestmark = pytest.mark.vllm


def test_a_head_size_vllms_cpu_attention_refuses_is_refused_before_loading(tiny_model_path, length_reward, tmp_path):
    """vLLM's CPU attention refuses head size 16 (the main suite's tiny model) deep inside engine start-up; refused
    first, with the sizes it supports and the fix. Decided from the model's config: no engine starts."""
    pytest.importorskip("vllm")
    args = OPEFOConfig(output_dir=str(tmp_path / "out"), use_vllm=True, use_cpu=True, report_to="none")
    message = (
        r"the model's attention head size is 16, which vLLM's CPU attention does not support \(it supports \[32, 64, "
        r".*\]\); use a model with one of those head sizes, or use_vllm=False"
    )
    with pytest.raises(ValueError, match=message):
        OPEFOTrainer(tiny_model_path, length_reward, args=args)
    assert os.listdir(tmp_path) == []
