"""The package's test helpers (opefo_trl.testing) that float64 references rest on."""

import pytest
import torch

pytestmark = pytest.mark.numerics


def test_a_float64_model_stays_float64_through_its_rms_norms_after_train_and_eval(tiny_model_path):
    """The float64 references (tests/trainer/test_distributed.py, benchmarks/precision.py) need every RMSNorm in
    float64. transformers 5.25 re-kernelizes a model at each train() / eval() switch (the `kernels` package, on by
    default), which reset the patched forward to Qwen2's own float32 computation at the first Trainer.train(): the
    two-rank `param` flow then differed from the single-process float64 one by up to 4% per token. Tolerance: float64
    rounding of a 64-wide mean and an rsqrt is ~1e-15 relative; Qwen2's float32 computation is ~1e-8 off."""
    from transformers import AutoModelForCausalLM

    from opefo_trl.testing import keep_rms_norm_in_model_dtype

    model = keep_rms_norm_in_model_dtype(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float64))
    model.train()  # what Trainer.train() does
    model.eval()
    norm = model.model.layers[0].input_layernorm
    hidden = torch.randn(3, 5, norm.weight.numel(), dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    expected = norm.weight * hidden / torch.sqrt(hidden.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    torch.testing.assert_close(norm(hidden), expected, rtol=1e-13, atol=0)
    # The check can tell: Qwen2's own float32 computation is far outside that tolerance.
    assert (type(norm).forward(norm, hidden) - expected).abs().max() > 1e-10
