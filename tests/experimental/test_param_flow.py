"""The `param` estimate and the exact step balance on a tiny float64 network (docs/algorithm.md section 4), checked
against what does not share their construction: autograd's per-token gradients, the measured entropy change of a real
SGD or torch AdamW step, and a float64 reference of a float32 run. The optimizer's update and the step model on their
own: tests/experimental/test_optimizer.py, tests/experimental/test_step_model.py."""

import copy
import threading

import pytest
import torch

from opefo_trl.experimental.optimizer import inner
from opefo_trl.experimental.param_flow import ParamFlowEstimator, imprecision, relative_error, token_count
from opefo_trl.experimental.param_jvp import completion_jvp, named_tangents
from opefo_trl.experimental.step_model import solve_step_balance
from opefo_trl.maths.entropy_flow import entropy_flow, flow_stats, token_weights, weight_signs
from opefo_trl.maths.ranks import single_process_sum

pytestmark = pytest.mark.numerics

PROMPT, COMPLETION, BATCH = 4, 6, 16


@pytest.fixture(scope="module")
def network(keep_dtype_rms_norm):
    """A random fp64 Qwen2 whose head is scaled so that its policies are peaked (far from the maximum entropy)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

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
    model = keep_dtype_rms_norm(Qwen2ForCausalLM(config).double())
    with torch.no_grad():
        model.lm_head.weight.mul_(25.0)
    return model


@pytest.fixture
def restored_network(network):
    saved = [p.detach().clone() for p in network.parameters()]
    yield network
    with torch.no_grad():
        for p, s in zip(network.parameters(), saved, strict=True):
            p.copy_(s)


def _rollout(model, seed):
    """Sampled completions of random prompts, their GRPO-style advantages and a token-mean loss factor."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, 40, (BATCH, PROMPT), generator=gen)
    torch.manual_seed(seed)
    with torch.no_grad():
        sequences = model.generate(prompts, do_sample=True, max_new_tokens=COMPLETION, min_new_tokens=COMPLETION)
    rewards = torch.randint(0, 2, (BATCH,), generator=gen).to(model.dtype)
    advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
    factor = torch.full((BATCH, COMPLETION), 1.0 / (BATCH * COMPLETION), dtype=model.dtype)
    return sequences, advantages, factor


def _scorer(model):
    def score(sequences):
        """log pi_t and H_t of the completion tokens (teacher forced), with the graph when grad is enabled."""
        logits = model(sequences).logits[:, PROMPT - 1 : -1]
        logp = torch.log_softmax(logits, -1)
        return logp.gather(-1, sequences[:, PROMPT:, None])[..., 0], -(logp.exp() * logp).sum(-1)

    return score


def _mean_entropy(model, sequences):
    with torch.no_grad():
        return float(_scorer(model)(sequences)[1].mean())


def _params(model):
    return [p for p in model.parameters() if p.requires_grad]


def _jvp(model):
    def jvp(sequences, direction):
        """u_t and dH_t of the completion tokens along ``direction`` (forward mode, float64 head maths)."""
        tangents = named_tangents(model, _params(model), direction)
        mask = torch.ones_like(sequences)
        result = completion_jvp(
            model, tangents, sequences, mask, COMPLETION, temperature=1.0, logit_scale=1.0, softcap=None
        )
        return result.logps_tangent, result.entropies_tangent

    return jvp


def _param_flow(params, score, jvp, batch, mask, coefficient, probe=(), reduce_sum=single_process_sum, optimizer=None):
    """The estimator of one micro-batch (and ``probe``: (batch, mask) pairs) fed its two stages, as
    experimental.param_estimate.ParamEstimate feeds it: ``score(batch) -> (logps, entropies)`` with the graph,
    ``jvp(batch, direction) -> (u_t, dH_t)``."""
    tokens = token_count([mask, *(probe_mask for _, probe_mask in probe)], reduce_sum)
    estimator = ParamFlowEstimator(params, tokens, reduce_sum, optimizer=optimizer)
    estimator.add_batch(*score(batch), mask, coefficient)
    for probe_batch, probe_mask in probe:
        estimator.add_probe(score(probe_batch)[1], probe_mask)
    direction = estimator.direction()
    if direction is not None:
        estimator.add_tangents(*jvp(batch, direction))
        for probe_batch, _ in probe:
            estimator.add_probe_tangent(jvp(probe_batch, direction)[1])
    return estimator, estimator.finish()


def _estimate(model, sequences, advantages, factor, optimizer=None):
    mask, coefficient = torch.ones_like(factor), factor * advantages[:, None]
    return _param_flow(_params(model), _scorer(model), _jvp(model), sequences, mask, coefficient, optimizer=optimizer)


def _loss(model, sequences, advantages, factor, weights=None):
    """-sum_t f_t w_t A_t log pi_t: the policy-gradient loss a GRPO step descends."""
    logps, _ = _scorer(model)(sequences)
    weights = torch.ones_like(logps) if weights is None else weights
    return -(factor * weights * advantages[:, None] * logps).sum()


def _sgd_entropy_change(model, sequences, advantages, factor, eta, weights=None):
    """Measured change of the mean entropy after one SGD step on the loss; parameters restored."""
    params = _params(model)
    gradient = torch.autograd.grad(_loss(model, sequences, advantages, factor, weights), params)
    before = _mean_entropy(model, sequences)
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, g in zip(params, gradient, strict=True):
            p.sub_(g, alpha=eta)
    after = _mean_entropy(model, sequences)
    with torch.no_grad():
        for p, s in zip(params, saved, strict=True):
            p.copy_(s)
    return after - before


def test_the_alignment_is_the_exact_directional_derivative_per_token(network):
    sequences, advantages, factor = _rollout(network, seed=0)
    _, flow = _estimate(network, sequences, advantages, factor)
    params = _params(network)
    logps, _ = _scorer(network)(sequences)
    direction = flow.entropy_grad  # D = identity without an optimizer
    for b, t in [(0, 0), (3, 2), (7, 5), (15, 1)]:
        exact = inner(torch.autograd.grad(logps[b, t], params, retain_graph=True), direction)
        # float64 forward and backward mode: equal to rounding (u is stored in float32)
        assert flow.alignment[0][b, t].item() == pytest.approx(exact, rel=1e-6, abs=1e-12)
    assert flow.check_error < 1e-12 and flow.lambda_error < 1e-12 and imprecision(flow) is None


@pytest.mark.parametrize("seed", range(5))
def test_predicted_change_matches_a_small_sgd_step(network, seed):
    sequences, advantages, factor = _rollout(network, seed)
    _, flow = _estimate(network, sequences, advantages, factor)
    eta = 1e-5
    measured = _sgd_entropy_change(network, sequences, advantages, factor, eta)
    net = float((flow.coefficients[0] * flow.alignment[0].double()).sum())  # sum_t c_t u_t
    assert abs(measured) > 1e-8
    assert relative_error(eta * net, measured) < 0.05


def test_opefo_with_the_param_flow_cancels_the_measured_change_of_an_sgd_step(network):
    ratios = []
    for seed in range(3):
        sequences, advantages, factor = _rollout(network, seed)
        _, flow = _estimate(network, sequences, advantages, factor)
        d = entropy_flow(flow.logps[0], flow.entropies[0], advantages, "param", entropy_alignment=flow.alignment[0])
        weights = token_weights(d, flow_stats(d.double(), factor).lambda_star).double()
        grpo = _sgd_entropy_change(network, sequences, advantages, factor, 1e-5)
        opefo = _sgd_entropy_change(network, sequences, advantages, factor, 1e-5, weights)
        ratios.append(abs(grpo) / abs(opefo))
    assert min(ratios) >= 20, ratios


def test_a_float32_estimate_is_the_float64_one_to_float32_rounding(network, keep_dtype_rms_norm):
    """The same weights in float32: lambda* within 2.5e-5 (a tenth of the paper's smallest lambda*) of the float64
    reference, and lambda_error (forward vs backward mode of the float32 run alone) of the size of that error."""
    sequences, advantages, factor = _rollout(network, seed=3)
    _, reference = _estimate(network, sequences, advantages, factor)
    single = keep_dtype_rms_norm(copy.deepcopy(network).float())
    _, flow = _estimate(single, sequences, advantages.float(), factor.float())
    error = abs(flow.lambda_star - reference.lambda_star)
    assert error <= 2.5e-5, error
    assert flow.lambda_error <= 2.5e-5 and reference.lambda_error < 1e-12
    assert imprecision(flow) is None


def test_a_forward_that_is_not_the_one_differentiated_is_reported():
    """A jvp of another function (here: twice the derivative) fails both checks, and the warning says why."""
    W = torch.randn(5, 3, dtype=torch.float64, requires_grad=True, generator=torch.Generator().manual_seed(1))
    x = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def policy(weight):
        logp = torch.log_softmax(x @ weight.T, -1)
        return logp[:, :1], -(logp.exp() * logp).sum(-1, keepdim=True)

    def wrong_jvp(batch, direction):
        u, dh = torch.func.jvp(policy, (W.detach(),), (direction[0],))[1]
        return 2 * u, 2 * dh

    coefficient = torch.tensor([[1.0], [-1.0], [0.5], [0.2]], dtype=torch.float64)
    mask = torch.ones(4, 1, dtype=torch.float64)
    _, flow = _param_flow([W], lambda batch: policy(W), wrong_jvp, None, mask, coefficient)
    assert flow.check_error == pytest.approx(1.0) and flow.lambda_error > 0.1
    assert "checks failed: the forward-mode flow and the backward-mode gradients disagree" in imprecision(flow)


class _RealAdamW:
    """A torch AdamW (default betas) on the float64 network, and the real step it takes from its current state on
    one batch with any token weights: the first-order change <grad Hbar, theta_after - theta_before> and the
    measured change of the batch's mean entropy (state and parameters restored unless kept)."""

    def __init__(self, model, lr):
        self.model, self.params, self.lr = model, _params(model), lr
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=0.0)

    def step(self, batch, weights, entropy_grad, lr=None, keep=False):
        sequences, advantages, factor = batch
        saved = [p.detach().clone() for p in self.params]
        state = {p: {k: v.clone() for k, v in self.optimizer.state[p].items()} for p in self.params}
        before = _mean_entropy(self.model, sequences)
        self.optimizer.zero_grad()
        _loss(self.model, sequences, advantages, factor, weights).backward()
        self.optimizer.param_groups[0]["lr"] = self.lr if lr is None else lr
        self.optimizer.step()
        self.optimizer.param_groups[0]["lr"] = self.lr
        first_order = inner(entropy_grad, [p.detach() - s for p, s in zip(self.params, saved, strict=True)])
        measured = _mean_entropy(self.model, sequences) - before
        if not keep:
            with torch.no_grad():
                for p, s in zip(self.params, saved, strict=True):
                    p.copy_(s)
            for p in self.params:
                self.optimizer.state[p] = state[p]
        return first_order, measured


def test_the_exact_step_balance_zeroes_the_real_adamw_step_from_the_first_step(restored_network):
    """Real torch AdamW, default betas, steps 1..6 of a balanced trajectory: on every step the first-order entropy
    change of the real step is <= 1e-3 of GRPO's on the same batch and state, and what is left of the measured change
    is second order (it shrinks ~4x when the learning rate halves), while GRPO's halves."""
    adamw = _RealAdamW(restored_network, lr=1e-5)
    for step in range(6):
        batch = _rollout(restored_network, seed=100 + step)
        sequences, advantages, factor = batch
        estimator, flow = _estimate(restored_network, *batch, optimizer=adamw.optimizer)
        d = advantages[:, None] * flow.alignment[0].double()
        signs = weight_signs(d)
        estimator.add_signed(_scorer(restored_network)(sequences)[0], signs * flow.coefficients[0])
        model = estimator.step_model(flow, estimator.signed_gradient())
        balance = solve_step_balance(model.change)
        assert balance.bracketed and -1.0 < balance.lam < 1.0
        weights = 1.0 + balance.lam * signs
        grpo_first, grpo_measured = adamw.step(batch, None, flow.entropy_grad)
        grpo_half = adamw.step(batch, None, flow.entropy_grad, lr=adamw.lr / 2)[1]
        balanced_first, balanced_measured = adamw.step(batch, weights, flow.entropy_grad)
        balanced_half = adamw.step(batch, weights, flow.entropy_grad, lr=adamw.lr / 2)[1]
        assert grpo_first == pytest.approx(balance.unweighted, rel=1e-9)  # the model's lambda = 0 is GRPO's step
        assert abs(balanced_first) <= 1e-3 * abs(grpo_first), (step, balanced_first, grpo_first)
        assert grpo_half / grpo_measured == pytest.approx(0.5, abs=0.05)  # GRPO: first order
        assert balanced_half / balanced_measured == pytest.approx(0.25, abs=0.05), step  # balanced: second order
        assert abs(balanced_measured) <= 0.2 * abs(grpo_measured)
        adamw.step(batch, weights, flow.entropy_grad, keep=True)  # the trajectory follows the balanced steps


# ----------------------------------------------------------------------------------------------------------------------
# A probe: Hbar over the batch and completions the update does not train on
# ----------------------------------------------------------------------------------------------------------------------


def _probe_estimate(model, batch, probe_batches, optimizer=None, reduce_sum=single_process_sum, jvp_lock=None):
    sequences, advantages, factor = batch
    jvp = _jvp(model)
    if jvp_lock is not None:  # forward-mode AD has one dual level per process: one thread's pass at a time

        def jvp(sequences, direction, unlocked=jvp):
            with jvp_lock:
                return unlocked(sequences, direction)

    probe = [(s, torch.ones(s.size(0), COMPLETION, dtype=model.dtype)) for s in probe_batches]
    mask, coefficient = torch.ones_like(factor), factor * advantages[:, None]
    return _param_flow(_params(model), _scorer(model), jvp, sequences, mask, coefficient, probe, reduce_sum, optimizer)


def _first_order_sgd(model, entropy_of, batch, weights=None):
    """<grad Hbar, -grad L>: the first-order change of ``entropy_of(model)`` (a mean token entropy, with its graph)
    per unit step of SGD on the batch's loss, from autograd's gradients alone."""
    params = _params(model)
    entropy_grad = torch.autograd.grad(entropy_of(model), params)
    loss_grad = torch.autograd.grad(_loss(model, *batch, weights), params)
    return -inner(entropy_grad, loss_grad)


def _mean_entropy_with_graph(sequences_list):
    def entropy_of(model):
        entropies = torch.cat([_scorer(model)(s)[1] for s in sequences_list])
        return entropies.mean()

    return entropy_of


@pytest.mark.parametrize("seed", range(3))
def test_a_probe_balance_zeroes_the_first_order_change_of_the_probe_s_entropy(network, seed):
    """The batch balance with two probe batches (other prompts, other completions): the reweighted SGD step leaves
    the mean entropy of the batch and the probe unchanged to first order, by autograd's gradients (which share none
    of the forward-mode pass that gives u_t), where the batch-only balance does not; a real small step then changes
    the probe's entropy at second order only."""
    batch = _rollout(network, seed)
    probe = [_rollout(network, seed + 10)[0], _rollout(network, seed + 20)[0]]
    sequences, advantages, factor = batch
    everything = _mean_entropy_with_graph([sequences, *probe])

    def balanced_weights(flow):
        d = entropy_flow(flow.logps[0], flow.entropies[0], advantages, "param", entropy_alignment=flow.alignment[0])
        return token_weights(d, flow_stats(d.double(), factor).lambda_star).double()

    _, with_probe = _probe_estimate(network, batch, probe)
    _, batch_only = _probe_estimate(network, batch, [])
    unweighted = _first_order_sgd(network, everything, batch)
    balanced = _first_order_sgd(network, everything, batch, balanced_weights(with_probe))
    batch_balanced = _first_order_sgd(network, everything, batch, balanced_weights(batch_only))
    assert with_probe.check_error < 1e-10 and with_probe.lambda_error < 1e-10
    # u_t is stored in float32: each c_t w_t u_t is off by at most 2^-24 of itself, and w_t <= 2.
    gross = float((with_probe.coefficients[0] * with_probe.alignment[0].double()).abs().sum())
    assert abs(balanced) <= 2 * 2**-24 * gross, (balanced, gross, unweighted)
    assert abs(batch_balanced) > 1e3 * abs(balanced), (batch_balanced, balanced)
    tokens = sequences.size(0) * COMPLETION * 3
    assert with_probe.entropy * tokens == pytest.approx(float(everything(network).detach()) * tokens, rel=1e-12)


class _ThreadRanks:
    """Data-parallel ranks as threads: ``reducer(rank)`` sums a tensor over all ranks, in rank order on each (what
    an all-reduce gives every rank)."""

    def __init__(self, size):
        self.barrier, self.slots = threading.Barrier(size, timeout=60), [None] * size

    def reducer(self, rank):
        def reduce_sum(tensor):
            self.slots[rank] = tensor.detach().clone()
            self.barrier.wait()
            total = sum(self.slots[1:], self.slots[0].clone())
            self.barrier.wait()
            return total

        return reduce_sum


def test_a_probe_balance_over_two_ranks_is_the_single_process_one(network):
    """Two ranks, each with half of the batch and half of the probe: the probe's entropy gradient and token count are
    summed like the batch's, so each rank's u_t, lambda* and Hbar are the single process's (float64; u_t stored in
    float32, so equal to one float32 ulp), and a rank that kept its probe to itself would differ."""
    sequences, advantages, factor = _rollout(network, 0)
    probe = [_rollout(network, 10)[0], _rollout(network, 20)[0]]
    _, single = _probe_estimate(network, (sequences, advantages, factor), probe)
    half = BATCH // 2
    ranks, results, lock = _ThreadRanks(2), [None, None], threading.Lock()

    def run(rank):
        rows = slice(rank * half, (rank + 1) * half)
        model = copy.deepcopy(network)  # a process of its own (forward-mode passes swap the module's parameters)
        batch = (sequences[rows], advantages[rows], factor[rows])
        results[rank] = _probe_estimate(model, batch, [probe[rank]], reduce_sum=ranks.reducer(rank), jvp_lock=lock)[1]

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for rank, flow in enumerate(results):
        assert flow is not None
        rows = slice(rank * half, (rank + 1) * half)
        torch.testing.assert_close(flow.alignment[0], single.alignment[0][rows], rtol=2**-23, atol=0)
        assert flow.lambda_star == pytest.approx(single.lambda_star, rel=1e-12)
        assert flow.entropy == pytest.approx(single.entropy, rel=1e-12)
    _, own_probe_only = _probe_estimate(network, (sequences[:half], advantages[:half], factor[:half]), [probe[0]])
    assert abs(own_probe_only.lambda_star - single.lambda_star) > 1e-3 * abs(single.lambda_star)
