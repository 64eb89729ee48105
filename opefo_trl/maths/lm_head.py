"""log pi_t and H_t of the sampled tokens from final hidden states and the LM head, differentiable and chunked.

Pure torch, no TRL import. The `param` estimate differentiates log pi_t and H_t with respect to the parameters in
their own precision: a float64 model's gradients must not pass through a float32 head (TRL's fused head computes in
float32 even for float64 weights, which made the float64 references float32 ones). The logits are transformed as the
sampling policy's, z = softcap(s (h W^T + b)) / T (``opefo_trl.maths.param_jvp``), and produced a chunk of tokens at a
time under activation checkpointing, so neither the forward nor the backward holds more than one [chunk, vocab]
block of logits.

Example:
    >>> import torch
    >>> h = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True); W = torch.randn(7, 4, dtype=torch.float64)
    >>> targets = torch.randint(0, 7, (2, 3))
    >>> logps, entropies = policy_log_probs(h, W, None, targets, temperature=0.5, token_chunk_size=2)
    >>> logp = torch.log_softmax(h @ W.T / 0.5, -1)
    >>> bool(torch.allclose(logps, logp.gather(-1, targets[..., None])[..., 0]))
    True
    >>> bool(torch.allclose(entropies, -(logp.exp() * logp).sum(-1)))
    True
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

#: Logits per chunk (tokens x vocabulary): 16 MiB in float32, e.g. 27 tokens of Qwen's 151,936-token vocabulary.
CHUNK_ELEMENTS = 1 << 22


def _chunk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    logit_scale: float,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    z = hidden @ weight.T
    if bias is not None:
        z = z + bias
    if logit_scale != 1.0:
        z = z * logit_scale
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    logp = torch.log_softmax(z / temperature, dim=-1)
    return logp.gather(-1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


def policy_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    token_chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log pi_t, H_t), each of ``targets``' shape, in the precision of ``hidden`` and ``weight`` promoted with
    float32; ``hidden`` (..., d) holds the hidden states that predict ``targets`` (...). ``token_chunk_size``:
    tokens per chunk (default: ``CHUNK_ELEMENTS`` logits)."""
    if token_chunk_size is None:
        token_chunk_size = max(1, CHUNK_ELEMENTS // weight.shape[0])
    dtype = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
    flat, flat_targets = hidden.reshape(-1, hidden.shape[-1]).to(dtype), targets.reshape(-1)
    weight = weight.to(dtype)
    bias = None if bias is None else bias.to(dtype)
    logps, entropies = [], []
    for start in range(0, flat.shape[0], token_chunk_size):
        rows = slice(start, start + token_chunk_size)
        args = (flat[rows], weight, bias, flat_targets[rows], temperature, logit_scale, softcap)
        logp, entropy = checkpoint(_chunk, *args, use_reentrant=False) if torch.is_grad_enabled() else _chunk(*args)
        logps.append(logp)
        entropies.append(entropy)
    return torch.cat(logps).reshape(targets.shape), torch.cat(entropies).reshape(targets.shape)
