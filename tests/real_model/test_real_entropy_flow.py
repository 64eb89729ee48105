"""lambda*, P and N on a real rollout of SmolLM2-135M-Instruct (30 layers, vocabulary 49,152, peaked low entropy),
against an independent float64 re-score of the same model and tokens.

The trainer samples one rollout (2 prompts x 4 completions of <= 24 tokens, temperature 0.7) and logs the flow sums
of its estimate. The test re-scores the micro-batch TRL trained on with a float64 copy of the model (RMSNorm and
rotary embeddings in float64 too), computes log pi_t, H_t and the flow per unit advantage straight from the full
softmax, and the sums over the same factor f_t = mask / tokens (TRL's `dapo` loss).

The tolerance is an error estimate: the same sums from a plain float32 forward of the model give
err = sum_t f_t |d_t(float32) - d_t(float64)|, the size of float32's rounding at this depth. P and N move by at most
sum_t f_t |delta d_t| (a token changing sets included), lambda* = (N - P) / (N + P) by at most twice that over
N + P. The trainer's float32 pipeline rounds differently from the plain forward (TRL's chunked head, other batch
shapes), by the same order: the bound is taken 8 x err.

`param` (u_t = <D grad Hbar, grad log pi_t>, under SGD: D = 1) is re-derived from scratch the same way: the
gradient of the mean entropy by backward, u_t by forward mode; its error estimate is the same computation in float32
against float64.
"""

import sys
import types
from pathlib import Path

import pytest
import torch

from opefo_trl import OPEFOConfig, OPEFOTrainer

sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))
from trainer_setup import base_settings, logged  # noqa: E402

from opefo_trl.trainer.token_weights import micro_batch_state

pytestmark = [pytest.mark.real_model, pytest.mark.numerics]

#: How many times the plain float32 forward's error the trainer's float32 pipeline may be off (module docstring).
ERROR_MARGIN = 8.0


def rollout_config(tmp_path, **overrides):
    # gradient_checkpointing off: TRL's default recomputes every layer in the backward, twice the time here
    settings = dict(max_completion_length=24, temperature=0.7, gradient_checkpointing=False, max_steps=1)
    return OPEFOConfig(**base_settings(tmp_path, **{"learning_rate": 1e-6, **settings, **overrides}))


def float64_throughout(model):
    """``model`` (a float64 Llama) with RMSNorm and the rotary angles computed in float64 (transformers computes
    both in float32 whatever the model's dtype)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from opefo_trl.testing import keep_rms_norm_in_model_dtype

    keep_rms_norm_in_model_dtype(model)
    config = model.config
    head_dim = config.head_dim
    theta = config.rope_parameters["rope_theta"]
    assert config.rope_parameters["rope_type"] == "default"
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)

    def rotary(self, x, position_ids):
        angles = position_ids[..., None].to(torch.float64) * inv_freq
        angles = torch.cat([angles, angles], -1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)

    for module in model.modules():
        if isinstance(module, LlamaRotaryEmbedding):
            module.forward = types.MethodType(rotary, module)
    return model


@pytest.fixture(scope="module")
def reference_models(real_model_path):
    """The real model in float64 (throughout) and in plain float32, for the re-score and its error estimate."""
    from transformers import AutoModelForCausalLM

    wide = float64_throughout(AutoModelForCausalLM.from_pretrained(real_model_path, dtype=torch.float64)).eval()
    narrow = AutoModelForCausalLM.from_pretrained(real_model_path, dtype=torch.float32).eval()
    return {"float64": wide, "float32": narrow}


def flows_from_logits(model, batch, temperature):
    """Per completion token: H_t and the flow per unit advantage of `opefo` and `full`, from the full softmax of
    ``model``'s logits in the model's dtype. `full` straight from its definition, u_t = sum_k dH/dz_k (e_a - pi)_k
    with dH/dz_k = -pi_k (log pi_k + H)."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    length = batch["completion_ids"].size(1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits[:, -length - 1 : -1] / temperature
    logp_all = torch.log_softmax(logits, -1)
    probs = logp_all.exp()
    entropy = -(probs * logp_all).sum(-1)
    logp = logp_all.gather(-1, batch["completion_ids"][..., None])[..., 0]
    pi = logp.exp()
    dh_dz = -probs * (logp_all + entropy[..., None])
    full = dh_dz.gather(-1, batch["completion_ids"][..., None])[..., 0] - (dh_dz * probs).sum(-1)
    opefo = -((1 - pi) ** 2) * (logp + entropy)
    return {"entropy": entropy.double(), "opefo": opefo.double(), "full": full.double()}


def sums(flow, factor):
    """P, N and lambda* of the per-token flow ``flow`` weighted by ``factor`` (float64)."""
    weighted = factor * flow
    increase, decrease = weighted.clamp(min=0).sum().item(), -weighted.clamp(max=0).sum().item()
    return increase, decrease, (decrease - increase) / (decrease + increase)


def train_one_rollout(model_path, dataset, reward, args):
    """One optimizer step of OPEFOTrainer; returns the trainer and the micro-batch TRL's loss received."""
    seen = []
    trainer = OPEFOTrainer(model=model_path, reward_funcs=reward, args=args, train_dataset=dataset)
    loss_call = trainer.micro_batches.loss_call

    def record(inputs):
        state = micro_batch_state(inputs)
        advantages = inputs["advantages"] if state is None else state.advantages
        if advantages.dim() == 1:
            advantages = advantages[:, None].expand_as(inputs["completion_mask"])
        keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "num_items_in_batch")
        seen.append({key: inputs[key].clone() for key in keys} | {"advantages": advantages.clone()})
        return loss_call(inputs)

    trainer.micro_batches.loss_call = record
    trainer.train()
    return trainer, seen


@pytest.mark.parametrize("estimate", ["opefo", "full"])
def test_lambda_star_p_and_n_equal_a_float64_rescore_of_the_real_rollout(
    real_model_path, arithmetic_prompts, length_reward, reference_models, tmp_path, estimate
):
    args = rollout_config(tmp_path, entropy_flow_estimate=estimate)
    assert args.loss_type == "dapo"  # the factor below: mask / the rollout batch's token count
    trainer, seen = train_one_rollout(real_model_path, arithmetic_prompts, length_reward, args)
    (batch,) = seen  # one rollout batch, one micro-batch
    mask = batch["completion_mask"].double()
    assert batch["num_items_in_batch"].item() == mask.sum().item()
    factor = mask / mask.sum()
    advantages = batch["advantages"].double()
    assert (advantages * mask).abs().sum() > 0, "the rollout should have reward variance"

    wide = flows_from_logits(reference_models["float64"], batch, trainer.temperature)
    narrow = flows_from_logits(reference_models["float32"], batch, trainer.temperature)
    increase, decrease, lam = sums(advantages * wide[estimate], factor)
    assert increase > 0 and decrease > 0
    error = (factor * advantages.abs() * (narrow[estimate] - wide[estimate]).abs()).sum().item()
    # The check must have teeth: float32's error is a small fraction of the flow.
    assert error < 1e-3 * (increase + decrease), (error, increase, decrease)

    bound = ERROR_MARGIN * error
    assert logged(trainer, "entropy_flow/increase")[0] == pytest.approx(increase, abs=bound)
    assert logged(trainer, "entropy_flow/decrease")[0] == pytest.approx(decrease, abs=bound)
    assert logged(trainer, "entropy_flow/lambda")[0] == pytest.approx(lam, abs=2 * bound / (increase + decrease))
    mean_entropy = ((wide["entropy"] * mask).sum() / mask.sum()).item()
    assert logged(trainer, "entropy")[0] == pytest.approx(mean_entropy, rel=1e-4)
    print(
        f"{estimate}: lambda* {logged(trainer, 'entropy_flow/lambda')[0]:.6g} (float64 {lam:.6g}), "
        f"P {logged(trainer, 'entropy_flow/increase')[0]:.6g} ({increase:.6g}), "
        f"N {logged(trainer, 'entropy_flow/decrease')[0]:.6g} ({decrease:.6g}), float32 error estimate {error:.3g}, "
        f"tokens {int(mask.sum())}, mean entropy {mean_entropy:.4f}"
    )


def param_flow_from_logits(model, batch, temperature):
    """u_t = <grad Hbar, grad log pi_t> of the `param` estimate under SGD (D = 1), from scratch: Hbar the mean token
    entropy of the completion tokens, its gradient by backward, u_t by forward mode along it, in ``model``'s dtype."""
    from torch.func import functional_call, jvp

    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    length = batch["completion_ids"].size(1)
    names, params = zip(*model.named_parameters(), strict=True)
    dtype = params[0].dtype

    def scores(*values):
        output = functional_call(model, dict(zip(names, values, strict=True)), (ids,), {"attention_mask": attention})
        logp_all = torch.log_softmax(output.logits[:, -length - 1 : -1] / temperature, -1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        return logp_all.gather(-1, batch["completion_ids"][..., None])[..., 0], entropy

    mask = batch["completion_mask"].to(dtype)
    _, entropy = scores(*params)
    direction = torch.autograd.grad((entropy * mask).sum() / mask.sum(), params)
    del entropy
    with torch.no_grad():
        _, (alignment, _) = jvp(scores, tuple(p.detach() for p in params), direction)
    return alignment.double()


def test_param_lambda_star_p_and_n_equal_a_float64_rescore_of_the_real_rollout(
    real_model_path, arithmetic_prompts, length_reward, tmp_path
):
    from transformers import AutoModelForCausalLM

    # SGD: under AdamW's first step D = 1 / (|g| + eps) weighs every parameter alike whatever the size of its
    # gradient, and the signs of the gradient's rounding-level entries, which float32 and float64 decide differently,
    # move P and N by ~6%: no float64 re-score can check the float32 estimate there.
    args = rollout_config(tmp_path, entropy_flow_estimate="param", optim="sgd", entropy_flow_preconditioner="none")
    assert args.loss_type == "dapo"
    trainer, seen = train_one_rollout(real_model_path, arithmetic_prompts, length_reward, args)
    (batch,) = seen
    mask = batch["completion_mask"].double()
    factor, advantages = mask / mask.sum(), batch["advantages"].double()
    temperature = trainer.temperature
    names = ("entropy_flow/increase", "entropy_flow/decrease", "entropy_flow/lambda", "entropy_flow/param_lambda_error")
    logs = {name: logged(trainer, name)[0] for name in names}
    del trainer  # the references need the memory

    alignments = {}
    for dtype in (torch.float64, torch.float32):  # eager attention: forward-mode AD through plain matmuls
        model = AutoModelForCausalLM.from_pretrained(real_model_path, dtype=dtype, attn_implementation="eager")
        if dtype == torch.float64:
            float64_throughout(model)
        alignments[dtype] = param_flow_from_logits(model.eval(), batch, temperature)
        del model
    wide, narrow = alignments[torch.float64], alignments[torch.float32]
    increase, decrease, lam = sums(advantages * wide, factor)
    error = (factor * advantages.abs() * (narrow - wide).abs()).sum().item()
    narrow_sums = sums(advantages * narrow, factor)
    print(
        f"param: lambda* {logs['entropy_flow/lambda']:.6g} (float64 {lam:.6g}, float32 reference "
        f"{narrow_sums[2]:.6g}), P {logs['entropy_flow/increase']:.6g} ({increase:.6g}, {narrow_sums[0]:.6g}), N "
        f"{logs['entropy_flow/decrease']:.6g} ({decrease:.6g}, {narrow_sums[1]:.6g}), float32 error estimate "
        f"{error:.3g} (the estimate's own: {logs['entropy_flow/param_lambda_error']:.3g} on lambda*), tokens "
        f"{int(mask.sum())}"
    )
    assert increase > 0 and decrease > 0
    assert error < 1e-3 * (increase + decrease), (error, increase, decrease)

    bound = ERROR_MARGIN * error
    assert logs["entropy_flow/increase"] == pytest.approx(increase, abs=bound)
    assert logs["entropy_flow/decrease"] == pytest.approx(decrease, abs=bound)
    assert logs["entropy_flow/lambda"] == pytest.approx(lam, abs=2 * bound / (increase + decrease))
