"""log pi_t and H_t of the sampled tokens from final hidden states and the LM head, differentiable and chunked.

Pure torch, no TRL import. The `param` estimate differentiates log pi_t and H_t with respect to the parameters in their
own precision: a float64 model's gradients must not pass through a float32 head (TRL's fused head computes in float32
even for float64 weights, which made the float64 references float32 ones). The logits are transformed as the sampling
policy's, z = softcap(s (h W^T + b)) / T (``opefo_trl.experimental.param_jvp``), and produced a chunk of tokens at a
time under activation checkpointing, so neither the forward nor the backward holds more than one [chunk, vocab] block of
logits.

Example:
    >>> import torch
    >>> h = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True); W = torch.randn(7, 4, dtype=torch.float64)
    >>> targets = torch.randint(0, 7, (2, 3))
    >>> logps, entropies, _ = policy_log_probs(h, W, None, targets, temperature=0.5, token_chunk_size=2)
    >>> logp = torch.log_softmax(h @ W.T / 0.5, -1)
    >>> bool(torch.allclose(logps, logp.gather(-1, targets[..., None])[..., 0]))
    True
    >>> bool(torch.allclose(entropies, -(logp.exp() * logp).sum(-1)))
    True

With ``entropy_tokens`` (a set of token ids) it also returns the entropy of the policy renormalised over them,
-sum_{k in S} q_k log q_k with q = softmax(z_S), which probability on tokens outside S does not change:
    >>> digits = torch.tensor([1, 4, 5])
    >>> _, _, digit_entropies = policy_log_probs(h, W, None, targets, temperature=0.5, entropy_tokens=digits)
    >>> q = torch.softmax(h @ W[digits].T / 0.5, -1)
    >>> bool(torch.allclose(digit_entropies, -(q * q.log()).sum(-1)))
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.utils.checkpoint import checkpoint

#: Logits per chunk (tokens x vocabulary): 16 MiB in float32, e.g. 27 tokens of Qwen's 151,936-token vocabulary.
CHUNK_ELEMENTS = 1 << 22


class PolicyScores(NamedTuple):
    """log pi_t and H_t of the sampled tokens, and the entropy over ``entropy_tokens`` (None without them)."""

    logps: torch.Tensor
    entropies: torch.Tensor
    token_set_entropies: torch.Tensor | None


def _logits(hidden, weight, bias, temperature: float, logit_scale: float, softcap: float | None) -> torch.Tensor:
    z = hidden @ weight.T
    if bias is not None:
        z = z + bias
    if logit_scale != 1.0:
        z = z * logit_scale
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    return z / temperature


def _entropy(logp: torch.Tensor) -> torch.Tensor:
    return -(logp.exp() * logp).sum(-1)


def _chunk(hidden, weight, bias, targets, temperature, logit_scale, softcap) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax(_logits(hidden, weight, bias, temperature, logit_scale, softcap), dim=-1)
    return logp.gather(-1, targets[:, None])[:, 0], _entropy(logp)


def _chunk_with_token_set(
    hidden, weight, bias, targets, temperature, logit_scale, softcap, entropy_tokens
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    z = _logits(hidden, weight, bias, temperature, logit_scale, softcap)
    logp = torch.log_softmax(z, dim=-1)
    token_set = torch.log_softmax(z[:, entropy_tokens], dim=-1)
    return logp.gather(-1, targets[:, None])[:, 0], _entropy(logp), _entropy(token_set)


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
    entropy_tokens: torch.Tensor | None = None,
) -> PolicyScores:
    """(log pi_t, H_t, H_t over ``entropy_tokens`` or None), each of ``targets``' shape, in the precision of
    ``hidden`` and ``weight`` promoted with float32; ``hidden`` (..., d) holds the hidden states that predict
    ``targets`` (...). ``token_chunk_size``: tokens per chunk (default: ``CHUNK_ELEMENTS`` logits)."""
    if token_chunk_size is None:
        token_chunk_size = max(1, CHUNK_ELEMENTS // weight.shape[0])
    dtype = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
    flat, flat_targets = hidden.reshape(-1, hidden.shape[-1]).to(dtype), targets.reshape(-1)
    weight = weight.to(dtype)
    bias = None if bias is None else bias.to(dtype)
    chunk: Callable[..., tuple[torch.Tensor, ...]] = _chunk
    extra: tuple = ()
    if entropy_tokens is not None:
        chunk, extra = _chunk_with_token_set, (entropy_tokens.to(flat.device),)
    parts: list[tuple[torch.Tensor, ...]] = []
    for start in range(0, flat.shape[0], token_chunk_size):
        rows = slice(start, start + token_chunk_size)
        args = (flat[rows], weight, bias, flat_targets[rows], temperature, logit_scale, softcap, *extra)
        parts.append(checkpoint(chunk, *args, use_reentrant=False) if torch.is_grad_enabled() else chunk(*args))
    joined = [torch.cat(column).reshape(targets.shape) for column in zip(*parts, strict=True)]
    return PolicyScores(joined[0], joined[1], joined[2] if entropy_tokens is not None else None)


def core_model(model: Any) -> Any:
    """The causal LM carrying the LM head: a PEFT model's base model, else the (unwrapped) model itself."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model
