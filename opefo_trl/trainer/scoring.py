"""The trainer's own scoring forwards, and the full-vocabulary statistics (the surprise-gap moments S_2, S_3).

:class:`Scorer` scores a TRL micro-batch's completion tokens (`Scores`: log pi_t, H_t, and where the flow needs them
the moments S_2, S_3) by one of two forwards:

- :meth:`Scorer.score`: TRL's own no-grad scoring path (`GRPOTrainer._get_per_token_logps_and_entropies`) in the
  training precision; with ``vocab``, also the surprise-gap moments S_2, S_3 from the hidden states of the same forward;
- :meth:`Scorer.score_full_precision`: the backbone and a chunked LM head of the library's own
  (`opefo_trl.maths.lm_head`) in the parameters' own precision (float32 / float64) with autocast off,
  differentiable when grad is enabled, as the `param` estimate needs (TRL's fused head computes in float32 even for
  float64 weights, and accelerate's mixed-precision wrapper of ``model.forward`` re-enables autocast).
- :meth:`Scorer.jvp`: the `param` estimate's forward-mode pass, the derivatives of log pi_t and H_t along a
  parameter direction.

:meth:`Scorer.capture_hidden_states` collects the backbone's final hidden states of the forwards inside a block (a
forward hook that lives only for the block), from which :meth:`Scorer.moments` projects the LM head in token x
vocabulary tiles (`opefo_trl.maths.vocab_stats`) without materialising [tokens, vocab] logits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import maybe_gather_lm_head_ctx

from opefo_trl.experimental.param_jvp import completion_jvp, named_tangents
from opefo_trl.maths.lm_head import core_model, policy_log_probs
from opefo_trl.maths.vocab_stats import vocab_stats
from opefo_trl.trainer.batch_state import Scores

#: TRL's scoring function: (model, input_ids, attention_mask, logits_to_keep, batch_size=, compute_entropy=) ->
#: (logps, entropies, aux_loss), `GRPOTrainer._get_per_token_logps_and_entropies` bound to the trainer.
TrlScore = Callable[..., tuple[torch.Tensor, torch.Tensor, Any]]


def sequence(batch: dict) -> tuple[torch.Tensor, torch.Tensor, int]:
    """input_ids, attention_mask and completion length of a TRL micro-batch."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    return input_ids, attention_mask, batch["completion_ids"].size(1)


def logit_scale(text_config) -> float:
    """The multiplier TRL's fused head applies to the logits (same lookup as `trl.trainer.utils.add_fused_lm_head`)."""
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        if getattr(text_config, name, None) is not None:
            return getattr(text_config, name)
    if getattr(text_config, "logits_scaling", None) is not None:
        scaling = text_config.logits_scaling
        return scaling if text_config.model_type == "hyperclovax" else 1 / scaling
    return 1.0


@dataclass
class Scorer:
    """Scoring forwards of the policy ``model()`` (the trainer's model, wrapped by accelerate once training starts).

    Args:
        model: returns the policy as the Trainer holds it (possibly DDP/DeepSpeed-wrapped).
        unwrap: accelerate's ``unwrap_model``.
        trl_score: TRL's scoring function (``TrlScore``).
        autocast: accelerate's ``autocast`` context (the training precision of the default forward).
        temperature: the training temperature the logits are divided by.
        head_in_float32: whether the LM head projects in float32 (``cast_lm_head_to_fp32``).
        batch_size: the micro-batch size TRL scores in (``per_device_train_batch_size``).
        checkpointing_kwargs: ``gradient_checkpointing_kwargs``.
        token_chunk_size, vocab_chunk_size: tiles of the vocabulary pass.
        entropy_tokens: the token ids whose renormalised entropy the full-precision forward and the forward-mode pass
            measure too (``Scores.token_set_entropies``; the `param` flow's entropy with
            ``entropy_flow_entropy='task_tokens'``).
    """

    model: Callable[[], Any]
    unwrap: Callable[[Any], Any]
    trl_score: TrlScore
    autocast: Callable[[], AbstractContextManager]
    temperature: float
    head_in_float32: bool
    batch_size: int
    checkpointing_kwargs: dict | None = None
    token_chunk_size: int = 512
    vocab_chunk_size: int = 16384
    #: ``entropy_flow_task_tokens`` when the `param` flow measures the entropy over them (else None).
    entropy_tokens: torch.Tensor | None = None

    def core(self) -> Any:
        return core_model(self.unwrap(self.model()))

    def score(self, batch: dict, *, vocab: bool = False) -> Scores:
        """TRL's no-grad scoring pass in the training precision (with ``vocab``, the surprise-gap moments too)."""
        input_ids, attention_mask, length = sequence(batch)
        model = self.model()
        with (
            torch.no_grad(),
            disable_gradient_checkpointing(model, self.checkpointing_kwargs),
            self.capture_hidden_states(vocab) as hidden,
        ):
            logps, entropies, _ = self.trl_score(
                model, input_ids, attention_mask, length, batch_size=self.batch_size, compute_entropy=True
            )
        return Scores(logps, entropies, *self.moments(hidden, length))

    def score_full_precision(self, batch: dict) -> Scores:
        """log pi_t and H_t (and the entropy over ``entropy_tokens``) in the parameters' precision, autocast off;
        differentiable when grad is enabled."""
        input_ids, attention_mask, length = sequence(batch)
        core = self.core()
        text_config = core.config.get_text_config()
        head = core.get_output_embeddings()
        # torch.autograd.grad works through non-reentrant checkpointing (transformers 5's default), not reentrant.
        keep_checkpointing = torch.is_grad_enabled() and not (self.checkpointing_kwargs or {}).get("use_reentrant")
        checkpointing = (
            nullcontext()
            if keep_checkpointing
            else disable_gradient_checkpointing(self.model(), self.checkpointing_kwargs)
        )
        with checkpointing, torch.autocast(input_ids.device.type, enabled=False):
            hidden = core.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            # Position i predicts token i + 1: the completion's T tokens are predicted from hidden[-T-1:-1].
            scores = policy_log_probs(
                hidden.last_hidden_state[:, -length - 1 : -1],
                head.weight,
                head.bias,
                input_ids[:, -length:],
                temperature=self.temperature,
                logit_scale=logit_scale(text_config),
                softcap=getattr(text_config, "final_logit_softcapping", None),
                entropy_tokens=self.entropy_tokens,
            )
        return Scores(scores.logps, scores.entropies, token_set_entropies=scores.token_set_entropies)

    @torch.no_grad()
    def jvp(
        self, batch: dict, params: Sequence[torch.Tensor], direction: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """u_t and dH_t: the derivatives of log pi_t and of the measured entropy (``Scores.measured_entropies``) along
        ``direction`` (one tensor per parameter of ``params``), by forward-mode AD with float64 head maths
        (`opefo_trl.experimental.param_jvp.completion_jvp`). The pass runs in eval mode (no dropout; no gradient
        checkpointing, which drops forward-mode tangents): a no-grad pass stores no activations, so nothing is lost."""
        input_ids, attention_mask, length = sequence(batch)
        model = self.unwrap(self.model())
        text_config = self.core().config.get_text_config()
        training = model.training
        model.eval()
        try:
            result = completion_jvp(
                model,
                named_tangents(model, params, direction),
                input_ids,
                attention_mask,
                length,
                temperature=self.temperature,
                logit_scale=logit_scale(text_config),
                softcap=getattr(text_config, "final_logit_softcapping", None),
                compute_dtype=torch.float64,
                entropy_tokens=self.entropy_tokens,
            )
        finally:
            model.train(training)
        return result.logps_tangent, result.entropies_tangent

    @contextmanager
    def capture_hidden_states(self, enabled: bool) -> Iterator[list[torch.Tensor]]:
        """The backbone's final hidden states of every forward inside the block (empty when not ``enabled``)."""
        chunks: list[torch.Tensor] = []
        if not enabled:
            yield chunks
            return

        def keep(module, args, output):
            hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
            chunks.append(hidden.detach())

        handle = self.core().base_model.register_forward_hook(keep)
        try:
            yield chunks
        finally:
            handle.remove()

    @torch.no_grad()
    def moments(
        self, hidden: list[torch.Tensor], logits_to_keep: int
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The surprise-gap moments S_2, S_3 at the completion positions, (B, T), from captured hidden states (None,
        None without), in the precision of TRL's fused head (its autocast dtype, or fp32 with ``head_in_float32``)."""
        if not hidden:
            return None, None
        core = self.core()
        text_config = core.config.get_text_config()
        head = core.get_output_embeddings()
        # Position i predicts token i + 1: the completion's T tokens are predicted from hidden[-T-1:-1].
        states = torch.cat(hidden)[:, -logits_to_keep - 1 : -1]
        device_type = states.device.type
        if self.head_in_float32:
            compute_dtype = torch.float32
        else:
            with self.autocast():
                autocast_on = torch.is_autocast_enabled(device_type)
                compute_dtype = torch.get_autocast_dtype(device_type) if autocast_on else states.dtype
        with maybe_gather_lm_head_ctx(head.weight, head.bias):
            stats = vocab_stats(
                states,
                head.weight,
                head.bias,
                temperature=self.temperature,
                logit_scale=logit_scale(text_config),
                softcap=getattr(text_config, "final_logit_softcapping", None),
                compute_dtype=compute_dtype,
                token_chunk_size=self.token_chunk_size,
                vocab_chunk_size=self.vocab_chunk_size,
            )
        return stats.moments()
