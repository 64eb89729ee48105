"""Full-vocabulary statistics of a softmax policy from hidden states and the LM head, in one chunked pass.

Pure torch, no TRL import. The ``full`` and ``opefo_centered`` entropy-flow estimates and the on-policy mean of the
others (docs/algorithm.md section 1) need, per position, H and the surprise-gap moments S_k = sum_v pi_v^k (log pi_v +
H) for k = 2, 3, i.e. sum pi^k and sum pi^k log pi. Materialising [tokens, vocab] logits for a 151,936-token vocabulary
is what blew up memory in early entropy logging, so the logits are produced in [token_chunk, vocab_chunk]
tiles and folded into running sums with an online max, never more than one tile at a time:

    m' = max(m, max_k z_k);  r = exp(m - m');  e_k = exp(z_k - m')
    S   <- r   S               + sum e            (so Z = e^m S)
    Sz  <- r  (Sz  + (m - m') S)  + sum e (z - m')     (sums of e (z - m), kept relative to the running max
    S2  <- r^2 S2              + sum e^2               so that H is not a difference of two large numbers)
    S2z <- r^2 (S2z + (m - m') S2) + sum e^2 (z - m')
    (S3, S3z likewise with e^3 and r^3)

    log Z = m + log S;  H = log S - Sz / S;  sum pi^k = Sk / S^k;  sum pi^k log pi = (Skz - Sk log S) / S^k

The logits are transformed exactly as TRL's fused head does: z = softcap(scale * (h W^T + b)) / temperature.

Example:
    >>> import torch
    >>> h, W = torch.randn(5, 8), torch.randn(50, 8)
    >>> stats = vocab_stats(h, W, vocab_chunk_size=7)
    >>> p = torch.softmax(h @ W.T, -1)
    >>> bool(torch.allclose(stats.sum_sq_probs, (p * p).sum(-1), atol=1e-6))
    True
    >>> s2, s3 = stats.moments()
    >>> gap = p.log() + stats.entropy.unsqueeze(-1)  # log pi_v + H
    >>> bool(torch.allclose(s3, (p**3 * gap).sum(-1), atol=1e-6))
    True
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class VocabStats(NamedTuple):
    """Per-position statistics, each of shape hidden.shape[:-1], fp32."""

    entropy: torch.Tensor
    sum_sq_probs: torch.Tensor
    sum_sq_probs_log_probs: torch.Tensor
    sum_cube_probs: torch.Tensor
    sum_cube_probs_log_probs: torch.Tensor

    def moments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The surprise-gap moments (S_2, S_3), S_k = sum_v pi_v^k (log pi_v + H): what the vocabulary-based
        entropy-flow estimates and the on-policy means need (``opefo_trl.maths.entropy_flow``)."""
        return (
            self.sum_sq_probs_log_probs + self.entropy * self.sum_sq_probs,
            self.sum_cube_probs_log_probs + self.entropy * self.sum_cube_probs,
        )


def _transform_(z: torch.Tensor, logit_scale: float, softcap: float | None, temperature: float) -> torch.Tensor:
    if logit_scale != 1.0:
        z.mul_(logit_scale)
    if softcap is not None:
        z.div_(softcap).tanh_().mul_(softcap)
    if temperature != 1.0:
        z.div_(temperature)
    return z


@torch.no_grad()
def vocab_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    compute_dtype: torch.dtype | None = None,
    token_chunk_size: int = 512,
    vocab_chunk_size: int = 16384,
) -> VocabStats:
    """Entropy, sum pi^k and sum pi^k log pi (k = 2, 3) of softmax(z).

    Args:
        hidden: (..., H) final hidden states.
        weight: (V, H) LM-head weight; under DeepSpeed ZeRO-3 the caller gathers it first.
        bias: optional (V,) LM-head bias.
        temperature, logit_scale, softcap: the logit transform of the sampling policy.
        compute_dtype: dtype of the projection h W^T (+ b), as in TRL's fused head (the autocast dtype, or fp32 with
            ``cast_lm_head_to_fp32``); default ``hidden.dtype``. The sums are always fp32.
        token_chunk_size, vocab_chunk_size: tile shape; peak extra memory is a few tiles of fp32.
    """
    if token_chunk_size < 1 or vocab_chunk_size < 1:
        raise ValueError("token_chunk_size and vocab_chunk_size must be positive.")
    if weight.dim() != 2 or weight.shape[0] == 0 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"The LM-head weight must be (vocab, {hidden.shape[-1]}), got {tuple(weight.shape)}; a DeepSpeed ZeRO-3 "
            "partitioned head has to be gathered first (trl.trainer.utils.maybe_gather_lm_head_ctx)."
        )
    lead_shape = hidden.shape[:-1]
    compute_dtype = hidden.dtype if compute_dtype is None else compute_dtype
    flat = hidden.reshape(-1, hidden.shape[-1]).to(compute_dtype)
    num_tokens, vocab = flat.shape[0], weight.shape[0]
    device = flat.device
    out = {name: torch.empty(num_tokens, device=device) for name in ("entropy", "s2", "s2l", "s3", "s3l")}

    for t0 in range(0, num_tokens, token_chunk_size):
        h = flat[t0 : t0 + token_chunk_size]
        n = h.shape[0]
        m = torch.full((n,), float("-inf"), device=device)
        s, sz, s2, s2z, s3, s3z = (torch.zeros(n, device=device) for _ in range(6))
        for v0 in range(0, vocab, vocab_chunk_size):
            z = h @ weight[v0 : v0 + vocab_chunk_size].to(compute_dtype).T
            if bias is not None:
                z += bias[v0 : v0 + vocab_chunk_size].to(compute_dtype)
            z = _transform_(z.float(), logit_scale, softcap, temperature)
            new_m = torch.maximum(m, z.amax(1))
            shift = torch.where(torch.isfinite(m), m - new_m, torch.zeros_like(m))  # 0 on the first tile
            r = shift.exp()
            z.sub_(new_m.unsqueeze(1))  # z - m' in place: the tile is not needed unshifted any more
            e = z.exp()
            e_sum, e_z = e.sum(1), torch.linalg.vecdot(e, z)
            e_power = e.square()  # e^2, then e^3 in place: two tile buffers serve the three moments
            e2_sum, e2_z = e_power.sum(1), torch.linalg.vecdot(e_power, z)
            e_power.mul_(e)
            e3_sum, e3_z = e_power.sum(1), torch.linalg.vecdot(e_power, z)
            r2 = r * r
            r3 = r2 * r
            sz = r * (sz + shift * s) + e_z
            s2z = r2 * (s2z + shift * s2) + e2_z
            s3z = r3 * (s3z + shift * s3) + e3_z
            s = r * s + e_sum
            s2 = r2 * s2 + e2_sum
            s3 = r3 * s3 + e3_sum
            m = new_m
        log_s = s.log()
        inv_s = s.reciprocal()
        inv_s2 = inv_s.square()
        inv_s3 = inv_s2 * inv_s
        sl = slice(t0, t0 + n)
        out["entropy"][sl] = log_s - sz / s
        out["s2"][sl] = s2 * inv_s2
        out["s2l"][sl] = (s2z - s2 * log_s) * inv_s2
        out["s3"][sl] = s3 * inv_s3
        out["s3l"][sl] = (s3z - s3 * log_s) * inv_s3

    def shaped(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(lead_shape)

    return VocabStats(*(shaped(out[name]) for name in ("entropy", "s2", "s2l", "s3", "s3l")))
