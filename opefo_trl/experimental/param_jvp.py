"""Exact Jacobian-vector products of the per-token log-probabilities and entropies along a parameter direction.

Pure torch, no TRL import. The `param` entropy-flow estimate (docs/algorithm.md s. 4) needs, for every completion
token t and a direction v given per trainable parameter,

    u_t = <v, grad_theta log pi_t>    and    dH_t = <v, grad_theta H_t>,

the directional derivatives of the token's log-probability and of its position's entropy. ``completion_jvp`` takes
both by forward-mode AD through the backbone and a closed form through the LM head, so they are exact to rounding
(the `param` estimate takes u_t this way; ``param_flow.ParamFlowEstimator`` checks it against its backward-mode
gradients).

The policy at a position with final hidden state h (after the final norm) is the temperature-scaled softmax of

    y = h W^T + b,    z = softcap(s y) / T,    softcap(x) = c tanh(x / c)  (identity when c is None),

with W, b the LM head, s the logit scale, T the temperature. Along the direction, with dh the tangent of h from the
backbone and dW, db those of the head,

    dy = dh W^T + h dW^T + db,    dz = s (1 - tanh^2(s y / c)) dy / T    (dz = s dy / T without softcap),
    d log pi_a = dz_a - sum_k pi_k dz_k = dz_a - E[dz],
    dH = -sum_k pi_k (log pi_k + H) dz_k = -(E[z dz] - E[z] E[dz])    (the covariance of z and dz under pi).

``head_jvp`` evaluates these in [token_chunk, vocab_chunk] tiles, folded into running sums relative to a running
maximum m as ``vocab_stats`` does (e = exp(z - m), r = exp(m - m') when the maximum moves to m'):

    S <- r S + sum e,    Sd <- r Sd + sum e dz,
    Sz <- r (Sz + (m - m') S) + sum e (z - m'),    Szd <- r (Szd + (m - m') Sd) + sum e (z - m') dz,

    log Z = m + log S,  H = log S - Sz / S,  E[dz] = Sd / S,  dH = -(Szd / S - (Sz / S) (Sd / S)),

in ``compute_dtype`` (float64 by default: E[dz] and the covariance are differences of sums over the vocabulary).

Example (the head alone, against forward-mode AD of a full softmax):
    >>> import torch
    >>> g = torch.Generator().manual_seed(0)
    >>> h, dh, W = (torch.randn(*shape, dtype=torch.float64, generator=g) for shape in ((2, 4, 8), (2, 4, 8), (50, 8)))
    >>> targets = torch.randint(0, 50, (2, 4), generator=g)
    >>> out = head_jvp(h, dh, W, None, None, None, targets, temperature=0.7, token_chunk_size=3, vocab_chunk_size=16)
    >>> def reference(h):
    ...     logp = torch.log_softmax(h @ W.T / 0.7, -1)
    ...     return logp.gather(-1, targets[..., None])[..., 0], -(logp.exp() * logp).sum(-1)
    >>> _, (dlogp, dentropy) = torch.func.jvp(reference, (h,), (dh,))
    >>> bool(torch.allclose(out.logps_tangent, dlogp) and torch.allclose(out.entropies_tangent, dentropy))
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.autograd.forward_ad as fwAD
from torch.nn.attention import SDPBackend, sdpa_kernel

from opefo_trl.maths.lm_head import core_model

#: Attention implementations ``completion_jvp`` runs through. SDPA runs on its math backend (plain matmul and
#: softmax, which have forward-mode rules; the fused CPU/GPU kernels have none) and eager as it is.
SUPPORTED_ATTENTION = ("sdpa", "eager")


class HeadJVP(NamedTuple):
    """log pi_t, H_t and their derivatives along the direction, each of the targets' shape, in compute_dtype."""

    logps: torch.Tensor
    entropies: torch.Tensor
    logps_tangent: torch.Tensor
    entropies_tangent: torch.Tensor


def _cast(x: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if x is None else x.to(dtype)


class _RunningSums:
    """S, Sd, Sz, Szd of the module docstring over the vocabulary tiles folded so far, relative to the running
    maximum m; with ``keep``, over the kept columns only."""

    def __init__(self, n: int, dtype: torch.dtype, device: torch.device):
        self.m = torch.full((n,), float("-inf"), dtype=dtype, device=device)
        self.s, self.sd, self.sz, self.szd = (torch.zeros(n, dtype=dtype, device=device) for _ in range(4))

    def fold(self, z: torch.Tensor, dz: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        tile_max = z.amax(1) if keep is None else z.masked_fill(~keep, float("-inf")).amax(1)
        new_m = torch.maximum(self.m, tile_max)
        shift = torch.where(torch.isfinite(self.m), self.m - new_m, torch.zeros_like(self.m))  # 0 on the first tile
        r = shift.exp()
        if keep is None:
            centred = z - new_m.unsqueeze(1)  # z - m'
            e = centred.exp()
        else:  # rows without a kept column yet keep a maximum of -inf: centre them on 0, their e is 0 anyway
            centred = z - torch.where(torch.isfinite(new_m), new_m, torch.zeros_like(new_m)).unsqueeze(1)
            e = torch.where(keep, centred.exp(), torch.zeros_like(centred))
        ez = e * centred
        self.sz = r * (self.sz + shift * self.s) + ez.sum(1)
        self.szd = r * (self.szd + shift * self.sd) + torch.linalg.vecdot(ez, dz)
        self.sd = r * self.sd + torch.linalg.vecdot(e, dz)
        self.s = r * self.s + e.sum(1)
        self.m = new_m

    def entropy(self) -> tuple[torch.Tensor, torch.Tensor]:
        """H = log S - Sz / S and dH = -(Szd / S - (Sz / S) (Sd / S))."""
        mean_z, mean_dz = self.sz / self.s, self.sd / self.s  # E[z - m], E[dz]
        return self.s.log() - mean_z, -(self.szd / self.s - mean_z * mean_dz)


@torch.no_grad()
def head_jvp(
    hidden: torch.Tensor,
    hidden_tangent: torch.Tensor | None,
    weight: torch.Tensor,
    weight_tangent: torch.Tensor | None,
    bias: torch.Tensor | None,
    bias_tangent: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    compute_dtype: torch.dtype = torch.float64,
    token_chunk_size: int = 256,
    vocab_chunk_size: int = 4096,
    entropy_tokens: torch.Tensor | None = None,
) -> HeadJVP:
    """log pi, H and their tangents at every position (formulas in the module docstring).

    Args:
        hidden: (..., H) final hidden states; ``hidden_tangent`` their tangent (same shape) or None (zero).
        weight: (V, H) LM-head weight; ``weight_tangent`` its tangent or None. Under DeepSpeed ZeRO-3 the caller
            gathers the head first.
        bias: optional (V,) LM-head bias; ``bias_tangent`` its tangent or None.
        targets: (...) token ids in [0, V): the tokens whose log-probabilities are returned.
        temperature, logit_scale, softcap: the logit transform of the sampling policy (as in TRL's fused head).
        compute_dtype: dtype of all the arithmetic, the projections included (inputs are cast tile by tile).
        token_chunk_size, vocab_chunk_size: tile shape. Peak extra memory: about four [token_chunk, vocab_chunk]
            tiles plus the [vocab_chunk, H] slices of W and dW, in compute_dtype, and the inputs cast to it.
        entropy_tokens: token ids S: H and its tangent are then those of the policy renormalised over S
            (q = softmax(z_S); the same sums over the tiles' columns in S, against a running maximum of their own).

    Returns HeadJVP of tensors of the targets' shape, in compute_dtype; no autograd graph.
    """
    if token_chunk_size < 1 or vocab_chunk_size < 1:
        raise ValueError("token_chunk_size and vocab_chunk_size must be positive.")
    if weight.dim() != 2 or weight.shape[0] == 0 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"The LM-head weight must be (vocab, {hidden.shape[-1]}), got {tuple(weight.shape)}; a DeepSpeed ZeRO-3 "
            "partitioned head has to be gathered first."
        )
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be targets' shape {tuple(targets.shape)} plus (H,).")
    for name, x, like in (
        ("hidden_tangent", hidden_tangent, hidden),
        ("weight_tangent", weight_tangent, weight),
        ("bias_tangent", bias_tangent, bias),
    ):
        if x is not None and (like is None or x.shape != like.shape):
            shape = None if like is None else tuple(like.shape)
            raise ValueError(f"{name} has shape {tuple(x.shape)}, but what it is the tangent of has shape {shape}.")
    vocab = weight.shape[0]
    flat_targets = targets.reshape(-1)
    if flat_targets.numel() and not (0 <= int(flat_targets.min()) and int(flat_targets.max()) < vocab):
        raise ValueError(f"targets must lie in [0, {vocab}).")

    dtype = compute_dtype
    flat = hidden.reshape(-1, hidden.shape[-1])
    flat_tangent = None if hidden_tangent is None else hidden_tangent.reshape(flat.shape)
    num_tokens, device = flat.shape[0], flat.device
    out = HeadJVP(*(torch.empty(num_tokens, dtype=dtype, device=device) for _ in range(4)))
    in_token_set = None
    if entropy_tokens is not None:
        in_token_set = torch.zeros(vocab, dtype=torch.bool, device=device)
        in_token_set[entropy_tokens.to(device)] = True

    for t0 in range(0, num_tokens, token_chunk_size):
        h = flat[t0 : t0 + token_chunk_size].to(dtype)
        dh = _cast(None if flat_tangent is None else flat_tangent[t0 : t0 + token_chunk_size], dtype)
        target = flat_targets[t0 : t0 + token_chunk_size]
        n = h.shape[0]
        sums = _RunningSums(n, dtype, device)
        token_set = None if in_token_set is None else _RunningSums(n, dtype, device)
        z_target, dz_target = (torch.zeros(n, dtype=dtype, device=device) for _ in range(2))
        for v0 in range(0, vocab, vocab_chunk_size):
            tile = slice(v0, v0 + vocab_chunk_size)
            w = weight[tile].to(dtype)
            y = h @ w.T  # [n, tile]
            dy = torch.zeros_like(y) if dh is None else dh @ w.T
            del w
            if weight_tangent is not None:
                dy.addmm_(h, weight_tangent[tile].to(dtype).T)
            if bias is not None:
                y += bias[tile].to(dtype)
            if bias_tangent is not None:
                dy += bias_tangent[tile].to(dtype)
            # z = softcap(s y) / T and dz = (dz/dy) dy, in place.
            y.mul_(logit_scale)
            dy.mul_(logit_scale)
            if softcap is not None:
                y.div_(softcap).tanh_()
                dy.mul_(1 - y.square())  # d/dx [c tanh(x / c)] = 1 - tanh^2(x / c)
                y.mul_(softcap)
            z, dz = y.div_(temperature), dy.div_(temperature)
            # The target's logit and its tangent, where the target lies in this tile.
            local = target - v0
            inside = (local >= 0) & (local < z.shape[1])
            index = local.clamp(0, z.shape[1] - 1).unsqueeze(1)
            z_target = torch.where(inside, z.gather(1, index).squeeze(1), z_target)
            dz_target = torch.where(inside, dz.gather(1, index).squeeze(1), dz_target)
            if token_set is not None:
                assert in_token_set is not None
                token_set.fold(z, dz, in_token_set[tile])
            sums.fold(z, dz)
            del y, dy, z, dz
        rows = slice(t0, t0 + n)
        log_s = sums.s.log()
        out.logps[rows] = z_target - sums.m - log_s
        out.logps_tangent[rows] = dz_target - sums.sd / sums.s
        entropy_sums = sums if token_set is None else token_set
        out.entropies[rows], out.entropies_tangent[rows] = entropy_sums.entropy()

    return HeadJVP(*(x.reshape(targets.shape) for x in out))


def named_tangents(
    model: torch.nn.Module, params: Sequence[torch.Tensor], tangents: Sequence[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The ``tangents`` argument of ``completion_jvp`` from parallel lists (as ``ParamFlowEstimator`` holds its
    parameters and direction): {name in model.named_parameters(): tangent}. Raises for a tensor not in the model."""
    names = {id(p): name for name, p in model.named_parameters()}
    result = {}
    for p, t in zip(params, tangents, strict=True):
        if id(p) not in names:
            raise ValueError(f"A parameter of shape {tuple(p.shape)} is not a parameter of the model.")
        result[names[id(p)]] = t
    return result


def _checked_core_model(model: torch.nn.Module) -> torch.nn.Module:
    """``core_model``, refusing what this pass cannot see through."""
    wrapper = type(model).__name__
    if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)) or (
        hasattr(model, "module") and not hasattr(model, "get_output_embeddings")
    ):
        raise ValueError(
            f"completion_jvp got a {wrapper} wrapper (DDP, FSDP or DeepSpeed engine): pass the unwrapped model "
            "(accelerator.unwrap_model(model), or model.module). The pass makes no collective calls: with the same "
            "tangents on every rank, each rank runs it on its own micro-batches."
        )
    if hasattr(model, "_orig_mod"):
        raise ValueError("completion_jvp got a torch.compile wrapper: pass model._orig_mod.")
    peft_config = getattr(model, "active_peft_config", None)
    if peft_config is not None:
        if getattr(peft_config, "is_prompt_learning", False):
            raise NotImplementedError(
                f"PEFT {peft_config.peft_type} adds virtual tokens in PeftModel.forward, which this pass (through the "
                "backbone's own forward) does not run; only adapters injected into the layers (LoRA and the like) are "
                "supported."
            )
    model = core_model(model)
    if not (hasattr(model, "get_decoder") and hasattr(model, "get_output_embeddings")):
        raise ValueError(
            f"completion_jvp needs a transformers causal LM (get_decoder, get_output_embeddings); got {wrapper}."
        )
    return model


def _check_pass(model: torch.nn.Module, core: torch.nn.Module) -> str:
    """Refuse the settings under which the forward-mode pass would be wrong or fail; return the attention
    implementation."""
    # transformers >= 5: is_activation_checkpointing (is_gradient_checkpointing is its deprecated alias).
    flag = (
        "is_activation_checkpointing"
        if hasattr(type(core), "is_activation_checkpointing")
        else "is_gradient_checkpointing"
    )
    if model.training and getattr(core, flag, False):
        raise ValueError(
            "completion_jvp with gradient checkpointing active (training mode): torch's reentrant checkpoint drops "
            "forward-mode tangents without an error, and whether a layer checkpoints in a no-grad pass depends on the "
            "transformers version. Run it with model.eval() or gradient checkpointing disabled "
            "(model.gradient_checkpointing_disable()); a no-grad pass stores no activations, so nothing is lost."
        )
    if model.training:
        rates = [module.p for module in model.modules() if isinstance(module, torch.nn.modules.dropout._DropoutNd)]
        rates.append(getattr(core.config, "attention_dropout", 0.0) or 0.0)
        if any(rate > 0 for rate in rates):
            raise ValueError(
                "completion_jvp with dropout active (training mode, dropout probability > 0): the derivatives would be "
                "those of one random dropout mask. Call model.eval() for this pass, or set the dropout rates to 0."
            )
    for p in model.parameters():
        if hasattr(p, "ds_id") or type(p).__name__ == "DTensor":
            raise NotImplementedError(
                "completion_jvp got partitioned parameters (DeepSpeed ZeRO-3 or FSDP): the forward-mode pass needs "
                "whole parameters. Run it without parameter sharding (DDP or a single device)."
            )
    attention = getattr(core.config, "_attn_implementation", None)
    if attention not in SUPPORTED_ATTENTION:
        raise NotImplementedError(
            f"completion_jvp: attention implementation {attention!r} has no forward-mode rule. Load the model with "
            "attn_implementation='sdpa' (or 'eager'), or switch with model.set_attn_implementation('sdpa')."
        )
    head = core.get_output_embeddings()  # type: ignore[operator]
    if head is None or list(head.children()) or not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise NotImplementedError(
            f"completion_jvp needs a plain linear LM head (h W^T + b); the model's is {type(head).__name__} (an "
            "adapter or a PEFT modules_to_save wrapper on lm_head is not supported)."
        )
    return attention


@torch.no_grad()
def completion_jvp(
    model: torch.nn.Module,
    tangents: Mapping[str, torch.Tensor],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    *,
    temperature: float,
    logit_scale: float,
    softcap: float | None,
    compute_dtype: torch.dtype = torch.float64,
    token_chunk_size: int = 256,
    vocab_chunk_size: int = 4096,
    entropy_tokens: torch.Tensor | None = None,
) -> HeadJVP:
    """log pi_t, H_t, u_t = d log pi_t and dH_t along ``tangents`` for the last ``logits_to_keep`` tokens, (B, T).

    Position i predicts token i + 1: the hidden states used are hidden[:, -T-1:-1] and the targets
    input_ids[:, -T:], T = logits_to_keep, as in TRL's scoring.

    Args:
        model: a transformers causal LM, or a PEFT model of one with injected adapters (LoRA), unwrapped.
        tangents: {parameter name: direction}, names as in ``model.named_parameters()`` (either name of a tied
            parameter, not both); parameters not named have a zero tangent. ``named_tangents`` builds it from
            parallel lists. Tangents are cast to their parameter's dtype.
        temperature, logit_scale, softcap: the sampling policy's logit transform (no defaults: a wrong one is silent).
        compute_dtype, token_chunk_size, vocab_chunk_size, entropy_tokens: those of ``head_jvp``.

    How: the backbone (``model.get_decoder()``, up to and including the final norm) runs once in forward mode,
    ``torch.func.functional_call`` substituting dual tensors (``torch.autograd.forward_ad``) for the parameters that
    have a tangent; then ``head_jvp`` on (h, dh) with the head's weight (tied to the embedding or not) and bias and
    their tangents. Dual tensors rather than ``torch.func.jvp``: they are ordinary tensors to the model's Python code
    (masks, caches, PEFT's bookkeeping), and the head's closed form takes the tangent of h without a [tokens, vocab]
    dual. The backbone computes in the parameters' own dtypes with autocast off; SDPA attention runs on its math
    backend (the fused kernels have no forward-mode rule), eager attention as it is. The model's parameters are
    not modified (functional_call swaps them in and back) and no autograd graph is built.

    Extra memory: the forward keeps a tangent next to every live activation (about twice a no-grad forward's peak,
    the attention weights [B, heads, L, L] of SDPA's math backend and their tangents included), the tangents cast to
    their parameters' dtypes where they differ, hidden states and tangents of the T positions in compute_dtype, and
    ``head_jvp``'s tiles. Nothing is stored per parameter beyond the caller's tangents.

    Refused, with the cause and the fix: DDP/DataParallel/FSDP/DeepSpeed and torch.compile wrappers (pass the
    unwrapped model), partitioned (ZeRO-3/FSDP) parameters, PEFT prompt learning, a wrapped LM head, attention other
    than sdpa/eager, gradient checkpointing in training mode, active dropout, unknown or misshapen tangents, and
    tangents on parameters the logits do not depend on. Non-finite results (e.g. a float64 model with eager attention
    and padding: transformers' eager softmax is float32 and turns float64's mask value into -inf) raise too.
    """
    core = _checked_core_model(model)
    attention = _check_pass(model, core)
    seq_len = input_ids.shape[1]
    if not 1 <= logits_to_keep < seq_len:
        raise ValueError(f"logits_to_keep must be in [1, {seq_len - 1}] for sequences of length {seq_len}.")

    decoder = core.get_decoder()  # type: ignore[operator]
    head = core.get_output_embeddings()  # type: ignore[operator]
    by_name = dict(model.named_parameters(remove_duplicate=False))
    by_id: dict[int, torch.Tensor] = {}
    for name, tangent in tangents.items():
        if name not in by_name:
            raise ValueError(f"tangents names {name!r}, which is not a parameter of the model.")
        p = by_name[name]
        if tuple(tangent.shape) != tuple(p.shape):
            raise ValueError(f"The tangent of {name} has shape {tuple(tangent.shape)}; the parameter {tuple(p.shape)}.")
        if id(p) in by_id:
            raise ValueError(f"tangents names the tied parameter {name} twice (under two names).")
        by_id[id(p)] = tangent.detach().to(device=p.device, dtype=p.dtype)

    decoder_names = {id(p): name for name, p in decoder.named_parameters(remove_duplicate=False)}
    head_ids = {id(head.weight)} | ({id(head.bias)} if getattr(head, "bias", None) is not None else set())
    outside = [name for name, p in by_name.items() if id(p) in by_id and id(p) not in decoder_names.keys() | head_ids]
    if outside:
        raise ValueError(f"tangents on parameters the logits do not depend on through backbone and head: {outside}.")

    kwargs: dict[str, Any] = dict(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    kernel = sdpa_kernel(SDPBackend.MATH) if attention == "sdpa" else contextlib.nullcontext()
    with fwAD.dual_level(), kernel, torch.autocast(input_ids.device.type, enabled=False):
        duals = {
            decoder_names[id(p)]: fwAD.make_dual(p.detach(), by_id[id(p)])
            for p in decoder.parameters()
            if id(p) in by_id
        }
        hidden = torch.func.functional_call(decoder, duals, (), kwargs)[0][:, -logits_to_keep - 1 : -1]
        hidden, hidden_tangent = fwAD.unpack_dual(hidden)
        # Outside the dual level nothing may still be a dual tensor: plain copies in compute_dtype.
        hidden = hidden.to(compute_dtype, copy=True)
        hidden_tangent = None if hidden_tangent is None else hidden_tangent.to(compute_dtype, copy=True)
    bias = getattr(head, "bias", None)
    result = head_jvp(
        hidden,
        hidden_tangent,
        head.weight,
        by_id.get(id(head.weight)),
        bias,
        None if bias is None else by_id.get(id(bias)),
        input_ids[:, -logits_to_keep:],
        temperature=temperature,
        logit_scale=logit_scale,
        softcap=softcap,
        compute_dtype=compute_dtype,
        token_chunk_size=token_chunk_size,
        vocab_chunk_size=vocab_chunk_size,
        entropy_tokens=entropy_tokens,
    )
    if not all(bool(torch.isfinite(x).all()) for x in result):
        raise ValueError(
            "completion_jvp: non-finite log-probabilities, entropies or derivatives. A float64 model with eager "
            "attention and padding does this (transformers' eager softmax is float32); use attn_implementation='sdpa'."
        )
    return result
