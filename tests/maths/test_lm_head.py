"""opefo_trl.maths.lm_head: log pi_t and H_t from hidden states through a chunked head, differentiable."""

import pytest
import torch

from opefo_trl.maths.lm_head import policy_log_probs

pytestmark = pytest.mark.numerics


@pytest.mark.parametrize("entropy_tokens", [None, torch.tensor([0, 5, 6, 30])])
def test_values_and_gradients_are_those_of_the_whole_softmax_in_float64(entropy_tokens):
    """Chunked (3 tokens a chunk) and checkpointed: the values and the gradients of sum log pi and of sum H (over the
    token set, renormalised, when given) are those of one float64 softmax over the whole [tokens, vocab] logits."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(2, 5, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    W = torch.randn(31, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 31, (2, 5), generator=gen)
    logps, entropies, token_set = policy_log_probs(
        h, W, None, targets, temperature=0.7, softcap=3.0, token_chunk_size=3, entropy_tokens=entropy_tokens
    )
    z = 3.0 * torch.tanh(h @ W.T / 3.0) / 0.7
    logp = torch.log_softmax(z, -1)
    want = [logp.gather(-1, targets[..., None])[..., 0], -(logp.exp() * logp).sum(-1)]
    got = [logps, entropies]
    if entropy_tokens is None:
        assert token_set is None
    else:
        q = torch.log_softmax(z[..., entropy_tokens], -1)
        want.append(-(q.exp() * q).sum(-1))
        got.append(token_set)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        grads = [torch.autograd.grad(x.sum(), (h, W), retain_graph=True) for x in (a, b)]
        for x, y in zip(*grads, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-11, atol=1e-12)
