"""Two data-parallel processes (torchrun, gloo) share one lambda equal to the single-process value on the union."""

import os
import socket
import subprocess
import sys

import pytest
import torch

from opefo_trl.maths.entropy_flow import flow_stats
from opefo_trl.trainer.batch_state import STATE_KEY

pytestmark = [pytest.mark.slow, pytest.mark.numerics]


def _run_two_ranks(
    model_path, tmp_path, accumulation, estimate, balance="batch", loss_type="dapo", dtype="float32", probe_prompts=0
):
    worker = os.path.join(os.path.dirname(__file__), "distributed_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    with socket.socket() as probe:  # a free port, so that parallel runs do not collide
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port, worker]
    cmd += [model_path, str(tmp_path), accumulation, estimate, balance, loss_type, dtype, str(probe_prompts)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == 2  # two rollout batches each
    return ranks


def _expected_factor(micro_batches, loss_type, world=2):
    """f_t of each rank's rollout written out independently of the trainer (TRL 1.16's normalisers, 1 / world for
    DDP's average), concatenated in the rank's micro-batch order."""
    accumulation = len(micro_batches)
    parts = []
    for batch in micro_batches:
        mask = batch["completion_mask"].double()
        if loss_type == "grpo":  # per sequence: 1 / (n_i * B * K)
            normaliser = mask.sum(-1, keepdim=True).clamp(min=1) * mask.size(0) * accumulation
        elif loss_type == "bnpo":  # per micro-batch: 1 / (its loss tokens * K)
            normaliser = mask.sum().clamp(min=1) * accumulation
        else:  # dapo: 1 / (N_items / W) with S = K strict on-policy
            normaliser = batch["num_items_in_batch"].double() / world
        parts.append(mask / normaliser / world)
    width = max(p.size(1) for p in parts)
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.size(1))) for p in parts])


@pytest.mark.parametrize(
    "accumulation,loss_type",
    [("1", "dapo"), ("2", "dapo"), ("2", "bnpo"), ("1", "grpo")],
    ids=["dapo-training_forward", "dapo-scoring_pass", "bnpo-scoring_pass", "grpo-training_forward"],
)
def test_lambda_star_is_reduced_over_ranks(warm_model_path, tmp_path, accumulation, loss_type):
    """Both ranks apply the lambda* of the union of their tokens, each weighted by its own factor f_t. The warm
    model ends its completions at different lengths, so with `bnpo` and `grpo` the normaliser differs between the
    ranks' micro-batches and sequences: a lambda* that dropped the factor (or reduced it wrongly) would differ from the
    union's computed here from first principles."""
    ranks = _run_two_ranks(warm_model_path, tmp_path, accumulation, "opefo", loss_type=loss_type)
    for step in range(2):
        local = [ranks[r][step] for r in range(2)]
        assert (
            not torch.equal(local[0]["logps"], local[1]["logps"]) or local[0]["logps"].shape != local[1]["logps"].shape
        )
        assert local[0]["lambda_star"] == local[1]["lambda_star"] == local[0]["lambda_applied"]
        factors = [_expected_factor(b["micro_batches"], loss_type) for b in local]
        if loss_type != "dapo":
            assert len(torch.cat([f[f > 0] for f in factors]).unique()) > 1, "the factor should vary"
        for b, factor in zip(local, factors, strict=True):
            torch.testing.assert_close(b["factor"].double(), factor, rtol=1e-6, atol=0)
        union = torch.cat([b["flow"][f > 0] for b, f in zip(local, factors, strict=True)])
        factor = torch.cat([f[f > 0] for f in factors])
        single = flow_stats(union, factor).lambda_star.item()
        # The trainer's f_t is float32: each token's is off by at most 2^-24 relative, which moves P and N by as
        # much and lambda* = (N - P) / (N + P) by at most 4 P N / (N + P)^2 * 2^-24 <= 2^-24.
        assert local[0]["lambda_star"] == pytest.approx(single, rel=0, abs=2**-24)
        per_rank = [flow_stats(b["flow"], f).lambda_star.item() for b, f in zip(local, factors, strict=True)]
        assert any(abs(p - single) > 1e-6 for p in per_rank), "a per-rank lambda* would have been the same"
        if loss_type != "dapo":  # the factor matters: the mask alone gives another lambda*
            unweighted = flow_stats(union, torch.ones_like(factor)).lambda_star.item()
            assert abs(unweighted - single) > 1e-6


def _pad_to(batch, prompt_length, completion_length, pad_id):
    """Left-pad the prompt, right-pad the completion (masks 0), as TRL pads one rank's rollout batch."""
    prompt_pad = prompt_length - batch["prompt_ids"].size(1)
    completion_pad = completion_length - batch["completion_ids"].size(1)
    out = dict(batch)
    out["prompt_ids"] = torch.nn.functional.pad(batch["prompt_ids"], (prompt_pad, 0), value=pad_id)
    out["prompt_mask"] = torch.nn.functional.pad(batch["prompt_mask"], (prompt_pad, 0), value=0)
    out["completion_ids"] = torch.nn.functional.pad(batch["completion_ids"], (0, completion_pad), value=pad_id)
    out["completion_mask"] = torch.nn.functional.pad(batch["completion_mask"], (0, completion_pad), value=0)
    return out


def _single_process(model_path, tmp_path, length_reward, keep_dtype_rms_norm, first, **settings):
    """One float64 process on the two ranks' ``first`` rollout (the same global batch, 8 rows, as one micro-batch):
    an OPEFOTrainer with ``settings`` and its optimizer, and the union of the ranks' micro-batches, padded as TRL pads
    one rollout."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opefo_trl import OPEFOConfig, OPEFOTrainer

    args = OPEFOConfig(
        output_dir=str(tmp_path / "single"), per_device_train_batch_size=8, num_generations=4, max_completion_length=10,
        bf16=False, use_cpu=True, report_to="none", max_steps=1, **settings,
    )  # fmt: skip
    rows = [{"prompt": [{"role": "user", "content": "unused"}]}] * 8
    model = keep_dtype_rms_norm(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64))
    trainer = OPEFOTrainer(
        model=model, processing_class=AutoTokenizer.from_pretrained(model_path), reward_funcs=length_reward,
        args=args, train_dataset=Dataset.from_list(rows),
    )  # fmt: skip
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1
    micro_batches = [b for record in first for b in record["micro_batches"]]
    prompt = max(b["prompt_ids"].size(1) for b in micro_batches)
    completion = max(b["completion_ids"].size(1) for b in micro_batches)
    padded = [_pad_to(b, prompt, completion, trainer.processing_class.pad_token_id) for b in micro_batches]
    union = {key: torch.cat([b[key] for b in padded]) for key in padded[0] if key != "num_items_in_batch"}
    union["num_items_in_batch"] = padded[0]["num_items_in_batch"]
    return trainer, micro_batches, union


@pytest.mark.parametrize("balance", ["batch", "step"])
def test_param_lambda_of_two_ranks_is_the_single_process_one(
    tiny_model_path, tmp_path, length_reward, keep_dtype_rms_norm, balance
):
    """float64 throughout: the entropy gradient, the loss gradients (a, and b for the step balance), Adam's
    preconditioner and the checks are all-reduced, so one process scoring both ranks' first rollout with the same
    initial parameters and optimizer finds the same per-token flow and lambda (a rank using only its own gradients
    would not). Tolerance: the two sides batch and pad the same tokens differently, which moves the float64 flow by
    ~1e-13 (relative); the flow is stored in float32, so two values differ by at most one float32 ulp (2^-23)."""
    ranks = _run_two_ranks(tiny_model_path, tmp_path, "1", "param", balance, dtype="float64")
    first = [ranks[r][0] for r in range(2)]
    for key in ("lambda_star", "lambda_applied"):
        assert first[0][key] == first[1][key], key
    torch.testing.assert_close(first[0]["weights"].unique(), first[1]["weights"].unique(), rtol=0, atol=0)
    trainer, micro_batches, union = _single_process(
        tiny_model_path, tmp_path, length_reward, keep_dtype_rms_norm, first, entropy_flow_estimate="param",
        opefo_balance=balance,
    )  # fmt: skip
    decided = []
    rollout_weights = trainer.token_method.rollout_weights
    trainer.token_method.rollout_weights = lambda *args: decided.append(rollout_weights(*args)) or decided[-1]
    trainer.rollout.weigh([union])
    single = union[STATE_KEY].unit_flow.double()
    row = 0
    for batch in micro_batches:
        rows, length = batch["completion_ids"].shape
        mask = batch["completion_mask"].bool()
        ours, theirs = single[row : row + rows, :length][mask], batch["unit_flow"].double()[mask]
        torch.testing.assert_close(theirs, ours, rtol=2**-23, atol=0)
        row += rows
    method = trainer.token_method
    assert method.lambda_star == pytest.approx(first[0]["lambda_star"], abs=1e-7)
    assert decided[0].lam == pytest.approx(first[0]["lambda_applied"], abs=1e-7)
    if balance == "step":
        assert decided[0].lam != pytest.approx(method.lambda_star, abs=1e-3)


def test_the_logged_flow_sums_of_two_ranks_are_the_single_process_ones(
    tiny_model_path, tmp_path, length_reward, keep_dtype_rms_norm
):
    """P, N and P - N are sums over every rank's tokens: both ranks log for their first step what one process logs
    for the same global batch at the same parameters (float64). With `grpo`, f_t = 1 / (n_i B K W) holds a rank's
    micro-batch rows B = 4 and W = 2 on the ranks, B = 8 and W = 1 here: the same float32 value. Sums averaged over
    the ranks instead of added would be half of these (lambda*, their ratio, would not move)."""
    ranks = _run_two_ranks(tiny_model_path, tmp_path, "1", "opefo", loss_type="grpo", dtype="float64")
    logs = [torch.load(tmp_path / f"log{r}.pt", weights_only=False) for r in range(2)]
    first = [next(entry for entry in log if "entropy_flow/increase" in entry) for log in logs]
    trainer, _, union = _single_process(
        tiny_model_path, tmp_path, length_reward, keep_dtype_rms_norm, [ranks[r][0] for r in range(2)],
        loss_type="grpo",
    )  # fmt: skip
    trainer.model.train()
    trainer.compute_loss(trainer.model, union)
    single = {name: values[0] for name, values in trainer._metrics["train"].items()}
    # u_t is float32: the ranks' float64 log pi_t and H_t (batched and padded otherwise) differ from these by ~1e-13
    # relative, so a token's u_t differs only where one lands across a float32 rounding step, and then by a step of
    # |log pi_t| + H_t (< 16 here: 2^-20), which moves P + N (~80 terms f_t |d_t|) by ~1e-8 of itself: 1e-6 allows
    # dozens. Measured: 4e-16 (the float64 sums in another order).
    gross = single["entropy_flow/increase"] + single["entropy_flow/decrease"]
    for name in ("entropy_flow/increase", "entropy_flow/decrease", "entropy_flow/net"):
        for rank in first:
            assert rank[name] == pytest.approx(single[name], rel=0, abs=1e-6 * gross), name


def test_the_fixed_probe_is_counted_once_over_two_ranks(tiny_model_path, tmp_path):
    """Each rank samples its share of the probe's prompts (prompts[rank::2]): together the two ranks hold every probe
    prompt once, num_generations completions each, so the probe's entropy, summed over ranks, counts each completion
    once. A copy where every rank sampled the whole probe counts it twice."""
    _run_two_ranks(tiny_model_path, tmp_path, "1", "param", probe_prompts=5)
    shares = [torch.load(tmp_path / f"probe{r}.pt", weights_only=False) for r in range(2)]
    contents = [[prompt[0]["content"] for prompt in share["prompts"]] for share in shares]
    assert sorted(contents[0] + contents[1]) == sorted(f"Probe {i}: what is {i} * 3?" for i in range(5))
    assert sum(share["sequences"] for share in shares) == 5 * 4  # num_generations=4 completions per prompt
