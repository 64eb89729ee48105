import pytest
import torch

from opefo_trl.maths.vocab_stats import vocab_stats

pytestmark = pytest.mark.numerics


def _reference(hidden, weight, bias, temperature, logit_scale=1.0, softcap=None):
    z = (hidden.double() @ weight.double().T + (0 if bias is None else bias.double())) * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    logp = torch.log_softmax(z / temperature, -1)
    p = logp.exp()
    return logp, -(p * logp).sum(-1), (p * p).sum(-1), (p * p * logp).sum(-1)


@pytest.mark.parametrize(
    "vocab,token_chunk,vocab_chunk", [(151_936, 7, 10_007), (151_936, 64, 151_936), (1001, 3, 97), (50, 1, 1)]
)
def test_chunked_statistics_match_a_float64_full_softmax(vocab, token_chunk, vocab_chunk):
    gen = torch.Generator().manual_seed(vocab)
    hidden = torch.randn(2, 9, 32, generator=gen)
    weight = torch.randn(vocab, 32, generator=gen) * 0.3
    bias = torch.randn(vocab, generator=gen)
    stats = vocab_stats(
        hidden,
        weight,
        bias,
        temperature=0.8,
        token_chunk_size=token_chunk,
        vocab_chunk_size=vocab_chunk,
    )
    _, entropy, s2, s2l = _reference(hidden, weight, bias, 0.8)
    assert stats.entropy.shape == (2, 9) and stats.entropy.dtype == torch.float32
    torch.testing.assert_close(stats.entropy.double(), entropy, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(stats.sum_sq_probs.double(), s2, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(stats.sum_sq_probs_log_probs.double(), s2l, rtol=1e-4, atol=1e-6)
    logp, _, _, _ = _reference(hidden, weight, bias, 0.8)
    p = logp.exp()
    gap = logp + entropy.unsqueeze(-1)
    torch.testing.assert_close(stats.sum_cube_probs.double(), (p**3).sum(-1), rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(stats.sum_cube_probs_log_probs.double(), (p**3 * logp).sum(-1), rtol=1e-4, atol=1e-6)
    moment2, moment3 = stats.moments()
    torch.testing.assert_close(moment2.double(), (p**2 * gap).sum(-1), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(moment3.double(), (p**3 * gap).sum(-1), rtol=1e-4, atol=1e-6)


def test_peaked_distribution_keeps_precision():
    """A near-deterministic policy (H ~ 1e-3) must not lose H to cancellation between log Z and E[z]."""
    hidden = torch.tensor([[1.0, 0.0]])
    weight = torch.cat([torch.tensor([[12.0, 0.0]]), torch.zeros(999, 2)])
    stats = vocab_stats(hidden, weight, vocab_chunk_size=333)
    _, entropy, s2, s2l = _reference(hidden, weight, None, 1.0)
    torch.testing.assert_close(stats.entropy.double(), entropy, rtol=1e-4, atol=0)
    torch.testing.assert_close(stats.sum_sq_probs_log_probs.double(), s2l, rtol=1e-4, atol=0)


def test_logit_scale_and_softcap_follow_the_trainer_transform():
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(4, 8, generator=gen) * 3, torch.randn(300, 8, generator=gen)
    stats = vocab_stats(hidden, weight, temperature=0.7, logit_scale=0.5, softcap=10.0, vocab_chunk_size=77)
    _, entropy, s2, _ = _reference(hidden, weight, None, 0.7, logit_scale=0.5, softcap=10.0)
    torch.testing.assert_close(stats.entropy.double(), entropy, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(stats.sum_sq_probs.double(), s2, rtol=1e-4, atol=1e-7)


def test_projection_runs_in_the_compute_dtype_like_trl_fused_head():
    """Under bf16 autocast TRL's head projects in bf16: the statistics must see the same rounded logits."""
    gen = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(6, 16, generator=gen), torch.randn(500, 16, generator=gen)
    in_bf16 = vocab_stats(hidden, weight, compute_dtype=torch.bfloat16, vocab_chunk_size=128)
    _, entropy_bf16, s2_bf16, _ = _reference(hidden.bfloat16().float(), weight.bfloat16().float(), None, 1.0)
    z = (hidden.bfloat16() @ weight.bfloat16().T).double()  # rounded to bf16 like the kernel's tile
    p = torch.softmax(z, -1)
    torch.testing.assert_close(in_bf16.sum_sq_probs.double(), (p * p).sum(-1), rtol=1e-4, atol=1e-7)
    in_fp32 = vocab_stats(hidden, weight, vocab_chunk_size=128)
    assert not torch.allclose(in_bf16.sum_sq_probs, in_fp32.sum_sq_probs, rtol=1e-6, atol=0)


def test_bad_chunk_sizes_are_rejected():
    with pytest.raises(ValueError, match="chunk_size"):
        vocab_stats(torch.zeros(1, 2), torch.zeros(3, 2), vocab_chunk_size=0)


def test_an_empty_or_mismatched_head_is_a_clear_error():
    with pytest.raises(ValueError, match="ZeRO-3 partitioned head has to be gathered"):
        vocab_stats(torch.zeros(2, 8), torch.zeros(0))
    with pytest.raises(ValueError, match=r"must be \(vocab, 8\)"):
        vocab_stats(torch.zeros(2, 8), torch.zeros(10, 4))
