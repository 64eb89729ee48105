"""Forward-mode u_t = <v, grad log pi_t> and dH_t (opefo_trl.experimental.param_jvp) against what does not share its
construction: torch.func.jvp of a full float64 softmax, float64 central finite differences of the model's own forward
(the full model with its LM head, not the backbone/head split), a backward pass for the entropy check, and the
finite-difference estimator's sensitivity to a 1e-7 parameter jitter."""

import copy
import math

import pytest
import torch

from opefo_trl.experimental.param_flow import ParamFlowEstimator, token_count
from opefo_trl.experimental.param_jvp import completion_jvp, head_jvp, named_tangents

pytestmark = pytest.mark.numerics

EPS64 = torch.finfo(torch.float64).eps
EPS32 = torch.finfo(torch.float32).eps
#: The logit transform the model tests use (a Gemma-like softcap included where parametrised).
TRANSFORM = dict(temperature=0.9, logit_scale=1.0, softcap=None)


# ----------------------------------------------------------------------------------------------------------------------
# References: a full float64 softmax, and the model's own forward with overridden parameters
# ----------------------------------------------------------------------------------------------------------------------


def _transform(logits, temperature, logit_scale, softcap):
    z = logits * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z / temperature


def _full_softmax(hidden, weight, bias, targets, *, temperature=1.0, logit_scale=1.0, softcap=None):
    """(log pi_target, H) from [tokens, vocab] logits in one piece: what head_jvp must equal."""
    logits = hidden @ weight.T + (0 if bias is None else bias)
    logp = torch.log_softmax(_transform(logits, temperature, logit_scale, softcap), -1)
    return logp.gather(-1, targets[..., None])[..., 0], -(logp.exp() * logp).sum(-1)


def _score(model, overrides, batch, dtype=torch.float64, transform=TRANSFORM):
    """log pi_t and H_t (B, T) of the completion from the model's own forward (its LM head, full logits) with
    ``overrides`` {name: tensor} swapped in; differentiable when grad is enabled. Softmax in ``dtype``."""
    input_ids, attention_mask, length = batch["input_ids"], batch["attention_mask"], batch["length"]
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=length + 1)
    logits = torch.func.functional_call(model, overrides, (), kwargs).logits[:, :-1].to(dtype)
    logp = torch.log_softmax(_transform(logits, **transform), -1)
    return logp.gather(-1, input_ids[:, -length:, None])[..., 0], -(logp.exp() * logp).sum(-1)


def _trainable(model):
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def _random_tangents(model, seed):
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(p.shape, generator=gen, dtype=p.dtype) for name, p in _trainable(model).items()}


def _central_difference(model, tangents, batch, rel, transform=TRANSFORM):
    """(d log pi_t, dH_t) by a float64 central difference with |e v| = rel |theta|, and max |log pi|, |H|."""
    params = _trainable(model)
    norm = math.sqrt(sum(float(p.detach().double().square().sum()) for p in params.values()))
    v_norm = math.sqrt(sum(float(t.double().square().sum()) for t in tangents.values()))
    e = rel * norm / v_norm
    with torch.no_grad():
        plus = _score(
            model, {n: p + e * tangents[n] for n, p in params.items() if n in tangents}, batch, transform=transform
        )
        minus = _score(
            model, {n: p - e * tangents[n] for n, p in params.items() if n in tangents}, batch, transform=transform
        )
    scale = max(float(plus[0].abs().max()), float(plus[1].abs().max()))
    return [(a - b) / (2 * e) for a, b in zip(plus, minus, strict=True)], e, scale


def _fd_with_error(model, tangents, batch, rel=1e-5, transform=TRANSFORM):
    """The central difference at step e and its error bound: curvature from the step-doubling (Richardson) estimate
    |FD(2e) - FD(e)| / 3 (the error is c e^2), plus the forward's rounding, 30 eps64 max|f| / e (measured at a step
    small enough for rounding to dominate: ~4 eps64 max|f| / e)."""
    fd, e, scale = _central_difference(model, tangents, batch, rel, transform)
    fd2, _, _ = _central_difference(model, tangents, batch, 2 * rel, transform)
    bounds = [(b - a).abs().max() / 3 + 30 * EPS64 * scale / e for a, b in zip(fd, fd2, strict=True)]
    return fd, bounds


def _batch(tokenizer, count=4, length=6):
    """Teacher-forced chat completions like the warm-up's, left-padded; the last ``length`` tokens are the
    completion; its mask has a few positions off."""
    texts = [
        f"<|im_start|>user\nWhat is {i} + 1?<|im_end|>\n<|im_start|>assistant\n{i + 1} 1 2 3<|im_end|>"
        for i in range(3, 3 + 3 * count, 3)
    ]
    encoded = tokenizer(texts, return_tensors="pt", padding=True)
    mask = torch.ones(count, length, dtype=torch.float64)
    mask[0, -2:] = 0
    return dict(input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"], length=length, mask=mask)


# ----------------------------------------------------------------------------------------------------------------------
# Fixtures: the warm tiny model (peaked policies) in float64 and float32, and a LoRA float64 model
# ----------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def warm_path(tiny_model_path, tmp_path_factory):
    from opefo_trl.testing import warm_up_tiny_model

    return warm_up_tiny_model(tiny_model_path, tmp_path_factory.mktemp("warm") / "model")


@pytest.fixture(scope="module")
def batch(warm_path):
    from transformers import AutoTokenizer

    return _batch(AutoTokenizer.from_pretrained(warm_path))


@pytest.fixture(scope="module")
def model32(warm_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(warm_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model64(model32, keep_dtype_rms_norm):
    """The float32 model's parameters upcast: float64 throughout (RMSNorm included)."""
    return keep_dtype_rms_norm(copy.deepcopy(model32).double())


# ----------------------------------------------------------------------------------------------------------------------
# The head
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "transform",
    [
        dict(temperature=1.0, logit_scale=1.0, softcap=None),
        dict(temperature=0.6, logit_scale=1.7, softcap=None),
        dict(temperature=1.3, logit_scale=0.8, softcap=4.0),
    ],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_head_jvp_is_forward_mode_ad_of_the_full_softmax(transform, with_bias):
    gen = torch.Generator().manual_seed(1)
    tokens, width, vocab = (3, 7), 16, 53

    def randn(*shape, scale=1.0):
        return scale * torch.randn(*shape, generator=gen, dtype=torch.float64)

    h, dh, W, dW = randn(*tokens, width), randn(*tokens, width), randn(vocab, width, scale=0.8), randn(vocab, width)
    b, db = (randn(vocab), randn(vocab)) if with_bias else (None, None)
    targets = torch.randint(0, vocab, tokens, generator=gen)
    out = head_jvp(h, dh, W, dW, b, db, targets, **transform, token_chunk_size=4, vocab_chunk_size=10)

    def reference(h, W, *bias):
        return _full_softmax(h, W, bias[0] if bias else None, targets, **transform)

    primals, directions = (h, W, *((b,) if with_bias else ())), (dh, dW, *((db,) if with_bias else ()))
    (logp, entropy), (dlogp, dentropy) = torch.func.jvp(reference, primals, directions)
    # Float64 rounding: each logit and its tangent carries ~ width eps |h||W| of error, the sums over the vocabulary
    # add vocab eps |terms|; 10x margin.
    dz_scale = float(dh.abs().sum(-1).max() * W.abs().max() + h.abs().sum(-1).max() * dW.abs().max())
    z_scale = float(h.abs().sum(-1).max() * W.abs().max())
    tol_value = 10 * (width + vocab) * EPS64 * max(z_scale, 1.0)
    tol_tangent = 10 * (width + vocab) * EPS64 * dz_scale * max(z_scale, 1.0)
    for got, want, tol in (
        (out.logps, logp, tol_value),
        (out.entropies, entropy, tol_value),
        (out.logps_tangent, dlogp, tol_tangent),
        (out.entropies_tangent, dentropy, tol_tangent),
    ):
        assert got.shape == tokens and got.dtype == torch.float64
        assert float((got - want).abs().max()) <= tol


@pytest.mark.parametrize("vocab_chunk_size", [5, 10, 53])
def test_head_jvp_over_a_token_set_is_forward_mode_ad_of_its_renormalised_entropy(vocab_chunk_size):
    """entropy_tokens S: H and dH of q = softmax(z_S) (tiles holding none of S included, and S's tokens far less
    likely than the others, as digits under a policy gone to junk), while log pi and its tangent stay the full
    softmax's."""
    gen = torch.Generator().manual_seed(4)
    tokens, width, vocab = (3, 7), 16, 53
    h, dh = (torch.randn(*tokens, width, generator=gen, dtype=torch.float64) for _ in range(2))
    W, dW = (torch.randn(vocab, width, generator=gen, dtype=torch.float64) for _ in range(2))
    token_set = torch.tensor([12, 13, 40, 41, 52])  # the first tiles hold none of them
    W[token_set] -= 3 * W.mean(0)  # S far below the maximum
    targets = torch.randint(0, vocab, tokens, generator=gen)
    out = head_jvp(
        h, dh, W, dW, None, None, targets, token_chunk_size=4, vocab_chunk_size=vocab_chunk_size,
        entropy_tokens=token_set,
    )  # fmt: skip

    def reference(h, W):
        logp, _ = _full_softmax(h, W, None, targets)
        q = torch.log_softmax((h @ W.T)[..., token_set], -1)
        return logp, -(q.exp() * q).sum(-1)

    (logp, entropy), (dlogp, dentropy) = torch.func.jvp(reference, (h, W), (dh, dW))
    full = head_jvp(h, dh, W, dW, None, None, targets, token_chunk_size=4, vocab_chunk_size=vocab_chunk_size)
    assert float((full.entropies - entropy).abs().max()) > 0.1  # not the full softmax's entropy
    for got, want in ((out.logps, logp), (out.entropies, entropy), (out.logps_tangent, dlogp)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.entropies_tangent, dentropy, rtol=1e-11, atol=1e-11)


def test_head_jvp_tiles_do_not_change_the_result_and_missing_tangents_are_zero():
    gen = torch.Generator().manual_seed(2)
    h, dW = torch.randn(9, 8, generator=gen), torch.randn(40, 8, generator=gen)
    W, targets = torch.randn(40, 8, generator=gen), torch.randint(0, 40, (9,), generator=gen)
    one_tile = head_jvp(h, None, W, dW, None, None, targets, token_chunk_size=100, vocab_chunk_size=100)
    for tokens, vocab in ((1, 1), (2, 7), (4, 39), (9, 40)):
        tiled = head_jvp(h, None, W, dW, None, None, targets, token_chunk_size=tokens, vocab_chunk_size=vocab)
        for a, b in zip(tiled, one_tile, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)
    nothing = head_jvp(h, None, W, None, None, None, targets)
    assert not nothing.logps_tangent.any() and not nothing.entropies_tangent.any()
    torch.testing.assert_close(nothing.logps, one_tile.logps)
    with pytest.raises(ValueError, match="targets must lie"):
        head_jvp(h, None, W, None, None, None, targets + 40)


# ----------------------------------------------------------------------------------------------------------------------
# Through the model
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("transform", [TRANSFORM, dict(temperature=1.1, logit_scale=1.5, softcap=3.0)])
def test_completion_jvp_is_the_float64_central_difference(model64, batch, transform):
    tangents = _random_tangents(model64, seed=3)
    before = {n: p.detach().clone() for n, p in model64.named_parameters()}
    with torch.enable_grad():  # no graph is built even so
        out = completion_jvp(
            model64, tangents, batch["input_ids"], batch["attention_mask"], batch["length"], **transform
        )
    assert all(not x.requires_grad for x in out)
    assert all(torch.equal(p, before[n]) for n, p in model64.named_parameters())  # nothing modified
    logps, entropies = _score(model64, {}, batch, transform=transform)
    torch.testing.assert_close(out.logps, logps.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(out.entropies, entropies.detach(), rtol=0, atol=1e-12)
    (dlogp, dentropy), (bound_logp, bound_entropy) = _fd_with_error(model64, tangents, batch, transform=transform)
    assert float((out.logps_tangent - dlogp).abs().max()) <= bound_logp
    assert float((out.entropies_tangent - dentropy).abs().max()) <= bound_entropy
    assert float(out.logps_tangent.abs().max()) > 1e3 * bound_logp  # the comparison is not vacuous


def test_the_mean_entropy_derivative_is_the_backward_pass_inner_product(model64, batch):
    """sum_t m_t dH_t / M = <grad Hbar, v>, with v = grad Hbar (the estimator's direction without an optimizer) and a
    random v."""
    params = _trainable(model64)
    mask, tokens = batch["mask"], batch["mask"].sum()
    with torch.enable_grad():
        _, entropies = _score(model64, {}, batch)
        grads = torch.autograd.grad((entropies * mask).sum() / tokens, list(params.values()))
    entropy_grad = dict(zip(params, grads, strict=True))
    for direction in (entropy_grad, _random_tangents(model64, seed=4)):
        exact = sum(float((entropy_grad[n] * direction[n]).sum()) for n in params)
        out = completion_jvp(
            model64, direction, batch["input_ids"], batch["attention_mask"], batch["length"], **TRANSFORM
        )
        derivative = float((out.entropies_tangent * mask).sum() / tokens)
        print(f"check identity: relative error {abs(derivative - exact) / abs(exact):.1e}")
        assert abs(derivative - exact) <= 1e-12 * abs(exact)


def test_a_float32_model_with_float64_head_maths_is_its_float64_reference_to_float32_rounding(model32, model64, batch):
    tangents64 = _random_tangents(model64, seed=5)
    tangents32 = {n: t.float() for n, t in tangents64.items()}
    args = (batch["input_ids"], batch["attention_mask"], batch["length"])
    out32 = completion_jvp(model32, tangents32, *args, **TRANSFORM)
    out64 = completion_jvp(model64, tangents64, *args, **TRANSFORM)
    assert all(x.dtype == torch.float64 for x in out32)
    # The float32 backbone rounds each activation and its tangent at ~ eps32 relative; through two layers and the
    # final norm the tangents differ by 12 (log pi) and 27 (H) eps32 of the largest |u_t| (measured).
    scale = float(out64.logps_tangent.abs().max())
    assert float((out32.logps_tangent - out64.logps_tangent).abs().max()) <= 100 * EPS32 * scale
    assert float((out32.entropies_tangent - out64.entropies_tangent).abs().max()) <= 100 * EPS32 * scale
    assert float((out32.logps - out64.logps).abs().max()) <= 10 * EPS32 * float(out64.logps.abs().max())


def test_lora_adapters_alone_against_the_float64_central_difference(warm_path, batch, keep_dtype_rms_norm):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = keep_dtype_rms_norm(AutoModelForCausalLM.from_pretrained(warm_path, dtype=torch.float64))
    assert base.config.tie_word_embeddings
    torch.manual_seed(6)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    model = get_peft_model(base, config).eval()
    tangents = _random_tangents(model, seed=7)
    assert tangents and all("lora_" in name for name in tangents)
    out = completion_jvp(model, tangents, batch["input_ids"], batch["attention_mask"], batch["length"], **TRANSFORM)
    (dlogp, dentropy), (bound_logp, bound_entropy) = _fd_with_error(model, tangents, batch)
    assert float((out.logps_tangent - dlogp).abs().max()) <= bound_logp
    assert float((out.entropies_tangent - dentropy).abs().max()) <= bound_entropy
    assert float(out.logps_tangent.abs().max()) > 1e3 * bound_logp


# ----------------------------------------------------------------------------------------------------------------------
# Jitter: the estimator's lambda* under a 1e-7 relative perturbation of every parameter
# ----------------------------------------------------------------------------------------------------------------------


def _lambda_star(model, batch, coefficients):
    """lambda* = -sum_t c_t u_t / sum_t |c_t u_t| of ParamFlowEstimator (float32 full-softmax scoring, as the
    trainer's float32 forward, and completion_jvp) along v = grad Hbar."""
    names, params = zip(*_trainable(model).items(), strict=True)
    mask = batch["mask"].float()
    estimator = ParamFlowEstimator(params, token_count([mask]))
    estimator.add_batch(*_score(model, {}, batch, dtype=torch.float32), mask, coefficients.float())
    direction = estimator.direction()
    assert direction is not None
    out = completion_jvp(
        model, dict(zip(names, direction, strict=True)), batch["input_ids"], batch["attention_mask"], batch["length"],
        **TRANSFORM,
    )  # fmt: skip
    estimator.add_tangents(out.logps_tangent, out.entropies_tangent)
    return estimator.finish().lambda_star


def test_a_1e7_parameter_jitter_moves_lambda_star_by_less_than_a_tenth_of_the_papers_smallest(model32, batch):
    """The paper's lambda* is 2.5e-4 .. 1.75e-3; a 1e-7 relative jitter of every float32 parameter (the size of float32
    rounding) moves the estimator's lambda* by less than 2.5e-5 (the finite-difference estimator moved it by ~1e-4 on
    this batch)."""
    gen = torch.Generator().manual_seed(8)
    coefficients = torch.randn(batch["mask"].shape, generator=gen, dtype=torch.float64) * batch["mask"]
    lam0 = _lambda_star(model32, batch, coefficients)
    moves = []
    for seed in range(3):
        jittered = copy.deepcopy(model32)
        noise = torch.Generator().manual_seed(100 + seed)
        with torch.no_grad():
            for p in jittered.parameters():
                p.mul_(1 + 1e-7 * torch.randn(p.shape, generator=noise))
        moves.append(abs(_lambda_star(jittered, batch, coefficients) - lam0))
    assert abs(lam0) > 1e-3
    assert max(moves) < 2.5e-5, moves


# ----------------------------------------------------------------------------------------------------------------------
# What is refused
# ----------------------------------------------------------------------------------------------------------------------


def test_refusals_name_the_cause_and_the_fix(model32, batch):
    args = (batch["input_ids"], batch["attention_mask"], batch["length"])
    tangents = _random_tangents(model32, seed=9)
    model = copy.deepcopy(model32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    with pytest.raises(ValueError, match="gradient checkpointing.*model.eval"):
        completion_jvp(model, tangents, *args, **TRANSFORM)
    model.eval()  # checkpointing stays enabled, but an eval-mode forward does not checkpoint
    torch.testing.assert_close(
        completion_jvp(model, tangents, *args, **TRANSFORM),
        completion_jvp(model32, tangents, *args, **TRANSFORM),
        rtol=0,
        atol=0,
    )
    model.gradient_checkpointing_disable()
    model.config.attention_dropout = 0.1
    model.train()
    with pytest.raises(ValueError, match="dropout"):
        completion_jvp(model, tangents, *args, **TRANSFORM)
    model.eval()
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(NotImplementedError, match="attn_implementation='sdpa'"):
        completion_jvp(model, tangents, *args, **TRANSFORM)
    with pytest.raises(ValueError, match="unwrapped model"):
        completion_jvp(torch.nn.DataParallel(model32), tangents, *args, **TRANSFORM)
    with pytest.raises(ValueError, match="not a parameter"):
        completion_jvp(model32, {"nope": torch.zeros(1)}, *args, **TRANSFORM)
    with pytest.raises(ValueError, match="twice"):
        weight = model32.lm_head.weight
        completion_jvp(model32, {"lm_head.weight": weight, "model.embed_tokens.weight": weight}, *args, **TRANSFORM)


def test_prompt_learning_a_wrapped_head_and_non_finite_results_are_refused(model32, model64, batch):
    from peft import LoraConfig, PromptTuningConfig, get_peft_model

    args = (batch["input_ids"], batch["attention_mask"], batch["length"])
    prompt_tuning = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2)
    prompt_tuned = get_peft_model(copy.deepcopy(model32), prompt_tuning)
    with pytest.raises(NotImplementedError, match="virtual tokens"):
        completion_jvp(prompt_tuned, {}, *args, **TRANSFORM)
    lora_head = get_peft_model(copy.deepcopy(model32), LoraConfig(r=2, target_modules=["lm_head"])).eval()
    with pytest.raises(NotImplementedError, match="plain linear LM head"):
        completion_jvp(lora_head, {}, *args, **TRANSFORM)
    # transformers' eager attention softmaxes in float32: float64's mask value becomes -inf, padded rows NaN.
    assert not batch["attention_mask"].all()
    eager64 = copy.deepcopy(model64)
    eager64.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="non-finite"):
        completion_jvp(eager64, _random_tangents(eager64, seed=10), *args, **TRANSFORM)


def test_eager_attention_gives_what_sdpa_gives_and_named_tangents_maps_lists(model32, batch):
    args = (batch["input_ids"], batch["attention_mask"], batch["length"])
    params = list(model32.parameters())
    tangents = named_tangents(model32, params, [torch.randn_like(p) for p in params])
    sdpa = completion_jvp(model32, tangents, *args, **TRANSFORM)
    eager = copy.deepcopy(model32)
    eager.set_attn_implementation("eager")
    assert model32.config._attn_implementation == "sdpa"
    for a, b in zip(completion_jvp(eager, tangents, *args, **TRANSFORM), sdpa, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()))
