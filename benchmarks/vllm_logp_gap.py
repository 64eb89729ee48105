"""Where vLLM's sampling log-probs part from the trainer's on the real model, one cause at a time.

Run in `.venv-vllm` (vLLM's CPU build; `make install-vllm`), one engine per process::

    python benchmarks/vllm_logp_gap.py --dtype bfloat16             # what TRL's colocate engine gets (dtype "auto")
    python benchmarks/vllm_logp_gap.py --dtype float32
    python benchmarks/vllm_logp_gap.py --dtype bfloat16 --kernels onednn   # vLLM's own prepacked CPU GEMMs

The engine is built as TRL 1.16's colocate ``VLLMGeneration`` builds it (``logprobs_mode="processed_logprobs"``, no
``dtype``: "auto", which for a float32 checkpoint is vLLM's preferred half type). It samples ``--prompts`` x
``--generations`` completions of SmolLM2-135M-Instruct (``opefo_trl.real_model``) at ``--temperature``; the same token
ids are then scored by transformers in float32 (the trainer's forward, ``bf16=False``) and in bfloat16, and by the
engine itself through ``prompt_logprobs`` (which are of the raw logits, temperature 1, whatever the request's), before
and after loading float32 weights into it the way TRL's weight sync does (``model.load_weights``): the same weights,
then a policy one AdamW step away (every weight moved by +-1e-5). Figures are mean / max |difference| per completion
token (TRL's ``sampling/sampling_logp_difference`` is ``vllm_sampling_vs_trainer_fp32``).

lambda* (OPEFO's ``opefo`` estimate, group-normalised advantages of a length reward) is computed on the same batch
from the trainer's log-probs, from vLLM's, and with the factor TRL's importance-sampling correction applies: its
default ``sequence_mask`` weighs every token of completion i by rho_i = exp(sum_t log pi_t - log pi_vllm,t), by 0 where
rho_i > 3; ``token_truncate`` by min(exp(log pi_t - log pi_vllm,t), 3).

``--kernels torch`` (the default) computes every linear layer with ``torch.nn.functional.linear`` on its weight, the
test tier's patch (``tests/vllm_cpu_gemm.py``) without which TRL's weight sync cannot load into vLLM's CPU build;
``--kernels onednn`` leaves vLLM's prepacked GEMMs (no weight sync then: that row is skipped).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from opefo_trl.maths.entropy_flow import flow_per_unit_advantage, flow_stats


def parse(argv):
    parser = argparse.ArgumentParser(prog="vllm_logp_gap.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto")
    parser.add_argument("--kernels", choices=["torch", "onednn"], default="torch")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--max_tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output_json", default=None)
    args = parser.parse_args(argv)
    if args.prompts < 1 or args.generations < 2 or args.max_tokens < 1 or args.temperature <= 0:
        parser.error("--prompts >= 1, --generations >= 2, --max_tokens >= 1 and --temperature > 0 are required")
    return args


def score(model, prompt_ids, completion_ids, temperature):
    """log pi and H of each completion token under a transformers model (the trainer's scoring: logits / T)."""
    logps, entropies = [], []
    with torch.no_grad():
        for prompt, completion in zip(prompt_ids, completion_ids, strict=True):
            ids = torch.tensor([prompt + completion])
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
            logp = torch.log_softmax(logits, -1)
            logps.append(logp.gather(-1, torch.tensor(completion)[:, None])[:, 0])
            entropies.append(-(logp.exp() * logp).sum(-1))
    return logps, entropies


def padded(rows):
    out = torch.zeros(len(rows), max(len(r) for r in rows))
    mask = torch.zeros_like(out)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(r, dtype=torch.float32)
        mask[i, : len(r)] = 1
    return out, mask


def gap(a, b):
    diff = torch.cat([(torch.as_tensor(x) - torch.as_tensor(y)).abs() for x, y in zip(a, b, strict=True)])
    return {"mean": float(diff.mean()), "max": float(diff.max()), "tokens": int(diff.numel())}


def lambda_star(logps, entropies, advantages, factor):
    unit = flow_per_unit_advantage(logps, entropies, "opefo")
    return float(flow_stats(advantages[:, None] * unit, factor).lambda_star)


#: TRL's default ``vllm_importance_sampling_clip_max``.
IS_CLIP_MAX = 3.0


def lambda_stars(trainer_logps, vllm_logps, entropies, mask, advantages) -> dict:
    """lambda* of one batch ((B, T) tensors, (B,) advantages) from the trainer's log-probs, from vLLM's in u_t, and
    under the factor TRL's importance-sampling correction applies (mask x ratio), with each completion's log ratio."""
    log_ratio = (trainer_logps - vllm_logps) * mask  # TRL's old log pi (the trainer's) - vLLM's sampling log pi
    sequence_ratio = torch.exp(log_ratio.sum(1, keepdim=True))
    kept = (sequence_ratio <= IS_CLIP_MAX).float()
    token_ratio = log_ratio.exp().clamp(max=IS_CLIP_MAX)
    return {
        "lambda_star": {
            "trainer_logps_no_correction": lambda_star(trainer_logps, entropies, advantages, mask),
            "vllm_logps_in_u_no_correction": lambda_star(vllm_logps, entropies, advantages, mask),
            # TRL's default, sequence_mask: a kept completion weighs its ratio, a masked one 0.
            "sequence_mask_default": lambda_star(trainer_logps, entropies, advantages, mask * sequence_ratio * kept),
            "token_truncate": lambda_star(trainer_logps, entropies, advantages, mask * token_ratio),
        },
        "sequence_log_ratio": [round(float(x), 4) for x in sequence_ratio.log().flatten()],
        "sequences_masked": int((kept == 0).sum()),
    }


def main(argv=None) -> int:
    args = parse(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.trainer.utils import ensure_master_addr_port
    from vllm import LLM, SamplingParams

    from opefo_trl.real_model import smollm2_135m_instruct

    if args.kernels == "torch":
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
        import vllm_cpu_gemm

        vllm_cpu_gemm.install()
    path = str(smollm2_135m_instruct())
    tokenizer = AutoTokenizer.from_pretrained(path)
    questions = [f"What is {i} + {i + 3}? Put the answer in \\boxed{{}}." for i in range(args.prompts)]
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in questions
    ]
    started = time.perf_counter()
    engine_options = {} if args.dtype == "auto" else {"dtype": args.dtype}
    # In this process, as TRL's colocate mode runs it (one rank of an external launcher).
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    ensure_master_addr_port()
    llm = LLM(
        model=path, max_model_len=256, seed=args.seed, max_num_batched_tokens=4096,
        distributed_executor_backend="external_launcher", logprobs_mode="processed_logprobs", **engine_options,
    )  # fmt: skip
    runner_model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    engine_dtype = str(next(runner_model.parameters()).dtype)
    sampling = SamplingParams(
        n=args.generations, temperature=args.temperature, max_tokens=args.max_tokens, logprobs=0, seed=args.seed
    )
    outputs = llm.generate(prompts, sampling, use_tqdm=False)
    prompt_ids, completion_ids, vllm_logps = [], [], []
    for output in outputs:
        for completion in output.outputs:
            prompt_ids.append(list(output.prompt_token_ids))
            completion_ids.append(list(completion.token_ids))
            vllm_logps.append([lp[t].logprob for t, lp in zip(completion.token_ids, completion.logprobs, strict=True)])

    def engine_prompt_logps(temperature):
        """The engine's own log-probs of the same completion tokens, read back as prompt log-probs."""
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=temperature)
        requests = [{"prompt_token_ids": p + c} for p, c in zip(prompt_ids, completion_ids, strict=True)]
        outputs = llm.generate(requests, params, use_tqdm=False)
        rows = []
        for request, out, completion in zip(requests, outputs, completion_ids, strict=True):
            ids = request["prompt_token_ids"]
            rows.append([out.prompt_logprobs[i][ids[i]].logprob for i in range(len(ids) - len(completion), len(ids))])
        return rows

    engine_rescored = engine_prompt_logps(args.temperature)
    engine_rescored_t1 = engine_prompt_logps(1.0)
    float32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    trainer_logps, trainer_entropies = score(float32, prompt_ids, completion_ids, args.temperature)
    trainer_logps_t1, _ = score(float32, prompt_ids, completion_ids, 1.0)
    bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    bf16_logps, _ = score(bf16, prompt_ids, completion_ids, args.temperature)
    del bf16

    figures = {
        "engine_dtype": engine_dtype,
        "kernels": args.kernels,
        "temperature": args.temperature,
        "gap": {
            "vllm_sampling_vs_trainer_fp32": gap(vllm_logps, trainer_logps),
            "vllm_sampling_vs_vllm_prompt_logprobs": gap(vllm_logps, engine_rescored),
            "vllm_prompt_logprobs_vs_trainer_fp32": gap(engine_rescored, trainer_logps),
            "vllm_prompt_logprobs_T1_vs_trainer_fp32_T1": gap(engine_rescored_t1, trainer_logps_t1),
            "vllm_prompt_logprobs_T1_vs_trainer_fp32_at_T": gap(engine_rescored_t1, trainer_logps),
            "transformers_bf16_vs_fp32": gap(bf16_logps, trainer_logps),
            "vllm_sampling_vs_transformers_bf16": gap(vllm_logps, bf16_logps),
        },
    }
    if args.kernels == "torch":
        # TRL's weight sync: every parameter of the trainer's (float32) model loaded by name.
        runner_model.load_weights(float32.state_dict().items())
        llm.reset_prefix_cache()  # cached prompt KV was computed from the weights before the sync
        synced = engine_prompt_logps(1.0)
        figures["gap"]["after_sync_vs_before_T1"] = gap(synced, engine_rescored_t1)
        # A policy one AdamW step away (every weight moved by +-1e-5, the first step's size at learning rate 1e-5),
        # synced into the engine and scored by both: the gap after a real sync, on the same tokens.
        generator = torch.Generator().manual_seed(args.seed)
        with torch.no_grad():
            for parameter in float32.parameters():
                sign = torch.randint(0, 2, parameter.shape, generator=generator).float() * 2 - 1
                parameter.add_(sign, alpha=1e-5)
        runner_model.load_weights(float32.state_dict().items())
        llm.reset_prefix_cache()
        moved_engine = engine_prompt_logps(1.0)
        moved_trainer, _ = score(float32, prompt_ids, completion_ids, 1.0)
        figures["gap"]["moved_sync_vs_before_T1"] = gap(moved_engine, engine_rescored_t1)
        figures["gap"]["moved_sync_vs_moved_trainer_fp32_T1"] = gap(moved_engine, moved_trainer)

    # lambda* on this batch: advantages of a length reward normalised within each prompt's group.
    lengths = torch.tensor([float(len(c)) for c in completion_ids]).view(args.prompts, args.generations)
    advantages = ((lengths - lengths.mean(1, keepdim=True)) / (lengths.std(1, keepdim=True) + 1e-4)).flatten()
    trainer_lp, mask = padded(trainer_logps)
    vllm_lp, _ = padded(vllm_logps)
    entropies, _ = padded(trainer_entropies)
    figures.update(lambda_stars(trainer_lp, vllm_lp, entropies, mask, advantages))
    figures["completion_tokens"] = [len(c) for c in completion_ids]
    figures["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(figures, indent=1))
    lambdas = figures["lambda_star"]
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(figures, f, indent=1)
    print(
        f"engine {engine_dtype}, kernels {args.kernels}: mean |logp_vllm - logp_trainer| "
        f"{figures['gap']['vllm_sampling_vs_trainer_fp32']['mean']:.4f}; lambda* trainer "
        f"{lambdas['trainer_logps_no_correction']:.4f}, vLLM log-probs {lambdas['vllm_logps_in_u_no_correction']:.4f}"
        f", TRL's default correction {lambdas['sequence_mask_default']:.4f}; "
        f"{statistics.fmean(len(c) for c in completion_ids):.1f} tokens per completion"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
