"""The `param` estimate on a tiny float64 network: the finite-difference flow is the exact first-order change of the
mean token entropy, it predicts what a small SGD or AdamW step really does, and OPEFO's lambda* from it cancels that
change (docs/algorithm.md section 4)."""

import pytest
import torch

from opefo_trl.entropy_flow import entropy_flow, flow_stats, lambda_star, token_weights
from opefo_trl.param_flow import (
    adam_momentum_term,
    adam_preconditioner_,
    carried_flow,
    evaluate_on_both_sides,
    finite_difference_step,
    inner,
    predicted_entropy_change,
    relative_error,
)

PROMPT, COMPLETION, BATCH = 4, 6, 16


@pytest.fixture(scope="module")
def network():
    """A random fp64 Qwen2 whose head is scaled so that its policies are peaked (far from the maximum entropy).

    Qwen2's RMSNorm computes in float32 whatever the model's dtype; here it keeps float64, so that the finite
    differences can be compared with autograd at float64 precision."""
    import types

    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    def rms_norm_in_input_dtype(self, hidden):
        return self.weight * hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    model = Qwen2ForCausalLM(config).double()
    for module in model.modules():
        if isinstance(module, Qwen2RMSNorm):
            module.forward = types.MethodType(rms_norm_in_input_dtype, module)
    with torch.no_grad():
        model.lm_head.weight.mul_(25.0)
    return model


def _rollout(model, seed):
    """Sampled completions of random prompts, their GRPO-style advantages and the token-mean loss factor."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, 40, (BATCH, PROMPT), generator=gen)
    torch.manual_seed(seed)
    with torch.no_grad():
        sequences = model.generate(prompts, do_sample=True, max_new_tokens=COMPLETION, min_new_tokens=COMPLETION)
    rewards = torch.randint(0, 2, (BATCH,), generator=gen).double()
    advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
    factor = torch.full((BATCH, COMPLETION), 1.0 / (BATCH * COMPLETION), dtype=torch.float64)
    return sequences, advantages, factor


def _score(model, sequences):
    """log pi_t and H_t of the completion tokens (teacher forced), with the graph."""
    logits = model(sequences).logits[:, PROMPT - 1 : -1]
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, sequences[:, PROMPT:, None])[..., 0], -(logp.exp() * logp).sum(-1)


def _mean_entropy(model, sequences):
    return _score(model, sequences)[1].mean()


def _objective(model, sequences, advantages, factor, weights=None):
    """sum_t f_t w_t A_t log pi_t: the policy-gradient objective whose gradient a GRPO step follows."""
    logps, _ = _score(model, sequences)
    weights = torch.ones_like(logps) if weights is None else weights
    return (factor * weights * advantages[:, None] * logps).sum()


def _params(model):
    return [p for p in model.parameters() if p.requires_grad]


def _alignment(model, sequences, direction):
    """u_t = <direction, grad log pi_t> by the central finite difference the trainer uses (a float64 step)."""
    params = _params(model)
    step = finite_difference_step(params, direction, relative=1e-6)
    plus, minus = evaluate_on_both_sides(params, direction, step, lambda: _score(model, sequences)[0].detach())
    return (plus - minus) / (2 * step)


def _sgd_entropy_change(model, sequences, advantages, factor, eta, weights=None):
    """Measured change of the mean entropy after one SGD ascent step on the objective; parameters restored."""
    params = _params(model)
    gradient = torch.autograd.grad(_objective(model, sequences, advantages, factor, weights), params)
    with torch.no_grad():
        before = _mean_entropy(model, sequences)
        plus, _ = evaluate_on_both_sides(params, gradient, eta, lambda: _mean_entropy(model, sequences))
    return float(plus - before), gradient


def test_finite_difference_alignment_is_the_exact_directional_derivative_per_token(network):
    sequences, _, _ = _rollout(network, seed=0)
    params = _params(network)
    direction = torch.autograd.grad(_mean_entropy(network, sequences), params)
    alignment = _alignment(network, sequences, direction)
    logps, _ = _score(network, sequences)
    for b, t in [(0, 0), (3, 2), (7, 5), (15, 1)]:
        exact = inner(torch.autograd.grad(logps[b, t], params, retain_graph=True), direction)
        assert alignment[b, t].item() == pytest.approx(exact, rel=1e-5, abs=1e-9)


@pytest.mark.parametrize("seed", range(5))
def test_predicted_change_matches_a_small_sgd_step(network, seed):
    sequences, advantages, factor = _rollout(network, seed)
    params = _params(network)
    entropy_gradient = torch.autograd.grad(_mean_entropy(network, sequences), params)
    flow = entropy_flow(*_score(network, sequences), advantages, "param", entropy_alignment=_alignment(
        network, sequences, entropy_gradient
    )).double()  # fmt: skip
    eta = 1e-5
    measured, gradient = _sgd_entropy_change(network, sequences, advantages, factor, eta)
    # sum_t f_t d_t is <grad Hbar, delta theta> / eta for delta theta = eta * grad(objective)
    assert float((factor * flow).sum()) == pytest.approx(inner(entropy_gradient, gradient), rel=1e-6)
    predicted = predicted_entropy_change(eta, 1.0, float((factor * flow).sum()))
    assert abs(measured) > 1e-8
    assert relative_error(predicted, measured) < 0.05


def test_opefo_with_the_param_flow_cancels_the_measured_change_of_an_sgd_step(network):
    ratios = []
    for seed in range(3):
        sequences, advantages, factor = _rollout(network, seed)
        params = _params(network)
        entropy_gradient = torch.autograd.grad(_mean_entropy(network, sequences), params)
        alignment = _alignment(network, sequences, entropy_gradient)
        flow = entropy_flow(*_score(network, sequences), advantages, "param", entropy_alignment=alignment).double()
        weights = token_weights(flow, flow_stats(flow, factor).lambda_star).double()
        grpo, _ = _sgd_entropy_change(network, sequences, advantages, factor, 1e-5)
        opefo, _ = _sgd_entropy_change(network, sequences, advantages, factor, 1e-5, weights)
        ratios.append(abs(grpo) / abs(opefo))
    assert min(ratios) >= 20, ratios


class _AdamWFromHistory:
    """A real torch AdamW after 40 steps on other batches (history in both moments), and the measured mean-entropy
    change of its next step on one batch from that same state, for any token weights."""

    def __init__(self, model, betas, lr=1e-5):
        self.model, self.params, self.lr = model, _params(model), lr
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, betas=betas, weight_decay=0.0)
        for seed in range(100, 140):
            sequences, advantages, factor = _rollout(model, seed)
            self.optimizer.zero_grad()
            (-_objective(model, sequences, advantages, factor)).backward()
            self.optimizer.step()
        self.state = {p: {k: v.clone() for k, v in self.optimizer.state[p].items()} for p in self.params}
        self.start = [p.detach().clone() for p in self.params]
        self.sequences, self.advantages, self.factor = _rollout(model, seed=20)

    def restore(self):
        with torch.no_grad():
            for p, s in zip(self.params, self.start, strict=True):
                p.copy_(s)
        for p in self.params:
            self.optimizer.state[p] = {k: v.clone() for k, v in self.state[p].items()}

    def flow(self):
        """The `param` flow with the Adam preconditioner, its gradient scale and the momentum term, as the trainer
        computes them before the step (the optimizer's state is read, not changed)."""
        model, sequences = self.model, self.sequences
        preconditioner = list(
            torch.autograd.grad(-_objective(model, sequences, self.advantages, self.factor), self.params)
        )
        gradient_scale = adam_preconditioner_(self.optimizer, self.params, preconditioner)
        entropy_gradient = torch.autograd.grad(_mean_entropy(model, sequences), self.params)
        direction = [g * d for g, d in zip(entropy_gradient, preconditioner, strict=True)]
        alignment = _alignment(model, sequences, direction)
        flow = entropy_flow(*_score(model, sequences), self.advantages, "param", entropy_alignment=alignment).double()
        return flow, gradient_scale, adam_momentum_term(self.optimizer, self.params, direction)

    def measured_change(self, weights=None):
        """Measured mean-entropy change of one real AdamW step from the saved state; restores it afterwards."""
        self.restore()
        before = float(_mean_entropy(self.model, self.sequences).detach())
        self.optimizer.zero_grad()
        (-_objective(self.model, self.sequences, self.advantages, self.factor, weights)).backward()
        self.optimizer.step()
        change = float(_mean_entropy(self.model, self.sequences).detach()) - before
        self.restore()
        return change


@pytest.fixture
def restored_network(network):
    saved = [p.detach().clone() for p in _params(network)]
    yield network
    with torch.no_grad():
        for p, s in zip(_params(network), saved, strict=True):
            p.copy_(s)


def test_opefo_with_the_adam_preconditioned_flow_cancels_a_real_adamw_step(restored_network):
    """AdamW without momentum (beta1 = 0), after 40 steps on other batches: this batch's balance is the whole step's,
    and the measured change of the real update shrinks >= 20x."""
    adamw = _AdamWFromHistory(restored_network, betas=(0.0, 0.999))
    flow, gradient_scale, momentum = adamw.flow()
    assert momentum == 0.0 and gradient_scale == 1.0
    factor = adamw.factor
    grpo = adamw.measured_change()
    predicted = predicted_entropy_change(adamw.lr, 1.0, float((factor * flow).sum()), gradient_scale)
    assert relative_error(predicted, grpo) < 0.1
    opefo = adamw.measured_change(token_weights(flow, flow_stats(flow, factor).lambda_star).double())
    assert abs(grpo) >= 20 * abs(opefo), (grpo, opefo)


def test_step_balance_cancels_a_real_adamw_step_with_momentum(restored_network):
    """AdamW with its default betas (0.9, 0.999): this batch's gradient is a tenth of the step and the momentum
    carries the rest. Balancing the batch (the paper's lambda*) leaves the momentum's share, as predicted;
    opefo_balance='step' (lambda* with the carried flow) cancels the whole step's measured change >= 20x."""
    adamw = _AdamWFromHistory(restored_network, betas=(0.9, 0.999))
    flow, gradient_scale, momentum = adamw.flow()
    factor, lr = adamw.factor, adamw.lr
    stats = flow_stats(flow, factor)
    assert gradient_scale == pytest.approx(0.1 / (1 - 0.9**41))

    def predicted(weights):
        return predicted_entropy_change(lr, 1.0, float((factor * weights * flow).sum()), gradient_scale, momentum)

    grpo = adamw.measured_change()
    assert relative_error(predicted(torch.ones_like(flow)), grpo) < 0.1  # the momentum term included

    batch_weights = token_weights(flow, stats.lambda_star).double()
    batch = adamw.measured_change(batch_weights)
    assert abs(momentum * lr) > 0.2 * abs(grpo)  # the momentum carries a sizeable share of the change...
    assert relative_error(predicted(batch_weights), batch) < 0.1  # ...which the batch balance leaves: -lr * momentum
    assert predicted(batch_weights) == pytest.approx(-lr * momentum, rel=1e-6)

    lam = lambda_star(stats.increase, stats.decrease, carried_flow(momentum, gradient_scale))
    assert -1.0 < float(lam) < 1.0, "the carried flow must be within this batch's reach for an exact balance"
    step_weights = token_weights(flow, lam).double()
    assert abs(predicted(step_weights)) <= 1e-6 * abs(predicted(torch.ones_like(flow)))
    step = adamw.measured_change(step_weights)
    assert abs(grpo) >= 20 * abs(step) and abs(batch) >= 5 * abs(step), (grpo, batch, step)


def test_adam_gradient_scale_is_that_of_the_stepped_parameters_whatever_their_order():
    used, unused = torch.zeros(3, requires_grad=True), torch.zeros(2, requires_grad=True)
    optimizer = torch.optim.AdamW([used, unused], lr=1e-3, betas=(0.9, 0.999))
    for _ in range(4):  # only `used` gets gradients: `unused` has no Adam state yet
        optimizer.zero_grad()
        used.sum().backward()
        optimizer.step()
    expected = 0.1 / (1 - 0.9**5)
    for order in ([used, unused], [unused, used]):
        gradient = [torch.ones_like(p) for p in order]
        assert adam_preconditioner_(optimizer, order, gradient) == pytest.approx(expected)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_the_adam_view_reproduces_the_torch_adamw_update(amsgrad):
    """Along any probe r, AdamW's next update is -lr * (gradient_scale * <r, D g> + <r D, momentum>), with D and the
    momentum term read from the state before the step."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(5, 3, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    optimizer = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.0, amsgrad=amsgrad)
    for _ in range(4):
        gradient = [torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in params]
        probe = [torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in params]
        preconditioner = [g.clone() for g in gradient]
        scale = adam_preconditioner_(optimizer, params, preconditioner)
        scaled_probe = [r * d for r, d in zip(probe, preconditioner, strict=True)]
        predicted = -1e-2 * (
            scale * inner(scaled_probe, gradient) + adam_momentum_term(optimizer, params, scaled_probe)
        )
        before = [p.detach().clone() for p in params]
        for p, g in zip(params, gradient, strict=True):
            p.grad = g.clone()
        optimizer.step()
        actual = inner(probe, [p.detach() - b for p, b in zip(params, before, strict=True)])
        assert actual == pytest.approx(predicted, rel=1e-6)


def test_the_adam_view_refuses_an_optimizer_without_second_moments():
    p = torch.zeros(3, requires_grad=True)
    optimizer = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones(3)
    optimizer.step()
    with pytest.raises(ValueError, match="entropy_flow_preconditioner='none'"):
        adam_preconditioner_(optimizer, [p], [torch.ones(3)])


def test_parameters_are_restored_bit_for_bit_even_when_evaluation_fails():
    p = torch.tensor([0.1, 0.2, 0.3], dtype=torch.float32)
    original = p.clone()
    values = evaluate_on_both_sides([p], [torch.tensor([1.0, 1.0, 1.0])], 1e-3, lambda: p.clone())
    assert torch.equal(p, original)
    torch.testing.assert_close(values[0] - values[1], torch.full((3,), 2e-3))
    with pytest.raises(RuntimeError, match="boom"):
        evaluate_on_both_sides([p], [torch.ones(3)], 0.5, lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    assert torch.equal(p, original)


def test_step_size_is_relative_to_the_parameters_and_a_zero_direction_is_refused():
    params, direction = [torch.full((4,), 10.0)], [torch.full((4,), 2.0)]
    assert finite_difference_step(params, direction, 1e-4) == pytest.approx(1e-4 * 20.0 / 4.0)
    with pytest.raises(ValueError, match="direction is zero"):
        finite_difference_step(params, [torch.zeros(4)])
