"""OPEFO in one file: TRL's `GRPOTrainer` plus one override, to read top to bottom and fork.

On-Policy Entropy Flow Optimization (Xu, Zhao, Wu, Luu, "Understanding and Preventing Entropy Collapse in RLVR with
On-Policy Entropy Flow Optimization", Findings of ACL 2026, arXiv:2605.11491). Once per rollout batch, when TRL's
`_generate_and_score_completions` hands the rollout over (before TRL shuffles and splits it into micro-batches):

1. log pi_t and H_t of every completion token under the current policy, from TRL's own scoring function (no grad);
2. d_t = A_t u_t, the first-order entropy change of token t's policy-gradient update, with the paper's estimate
   u_t = -(1 - pi_t)^2 (log pi_t + H_t);
3. P = sum of f_t d_t over S+ = {d_t > 0}, N = sum of f_t |d_t| over S- = {d_t < 0}, over the whole rollout batch and
   all ranks; f_t is the factor TRL's loss applies to A_t grad log pi_t (its mask and normalisation), so that P and N
   are the flows of the update TRL really applies;
4. lambda* = (N - P) / (N + P), and w_t = 1 + lambda* on S+, 1 - lambda* on S-: then (1 + lambda*) P =
   (1 - lambda*) N, the net first-order entropy flow of the update is zero;
5. the advantages, (B,), become A_t w_t, (B, T), which TRL's loss takes as they are. The weights lie in [0, 2], so
   scaling A_t by w_t is exactly weighting token t's loss, clipping included.

This is exact where TRL's importance ratio is 1 when the loss is taken (strictly on-policy: one optimizer step per
rollout batch) and for the loss types whose f_t `token_factor` computes; `check_args` refuses the rest. The library
(`opefo_trl.OPEFOTrainer`) computes the same lambda*, weights and advantages bit for bit
(tests/examples/test_opefo_minimal.py), and adds the other loss types and settings, the diagnostics, the other flow
estimates and methods, and its checks.

Run it like TRL's GRPO script, on a conversational data set with a `solution` column (TRL's `accuracy_reward`):

    python examples/opefo_minimal.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \
        --dataset_name trl-lib/DeepMath-103K --output_dir opefo-minimal
"""

from __future__ import annotations

import torch
from trl import GRPOConfig, GRPOTrainer, ModelConfig, ScriptArguments, TrlParser
from trl.models.utils import disable_gradient_checkpointing

#: The loss types whose f_t `token_factor` computes (bnpo normalises by each micro-batch's token count, which is only
#: known after TRL's split; cispo and vespo weigh each token by a function of its ratio; sapo is not mirrored here).
LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "luspo")


def check_args(args: GRPOConfig) -> None:
    """Refuse, before training, a configuration for which this file's lambda* would not balance TRL's update."""
    refused = {
        f"loss_type={args.loss_type!r} (use one of {LOSS_TYPES})": args.loss_type not in LOSS_TYPES,
        f"num_iterations={args.num_iterations} (OPEFO is on-policy: use 1)": args.num_iterations != 1,
        f"steps_per_generation={args.steps_per_generation} (leave it unset: it then equals "
        f"gradient_accumulation_steps={args.gradient_accumulation_steps})": args.steps_per_generation
        != args.gradient_accumulation_steps,
        f"top_entropy_quantile={args.top_entropy_quantile} (use 1.0)": args.top_entropy_quantile < 1.0,
        f"off_policy_mask_threshold={args.off_policy_mask_threshold} (leave it unset)": args.off_policy_mask_threshold
        is not None,
        f"importance_sampling_level={args.importance_sampling_level!r} (use 'token')": args.importance_sampling_level
        != "token",
        f"delta={args.delta} (leave it unset)": args.delta is not None and args.delta < 1.0,
        "use_liger_kernel=True (use False)": args.use_liger_kernel,
    }
    problems = [problem for problem, is_set in refused.items() if is_set]
    if problems:
        raise ValueError(
            f"opefo_minimal.py computes TRL's per-token loss factor only for strictly on-policy {LOSS_TYPES} losses; "
            f"this configuration has {'; '.join(problems)}. Change it, or use opefo_trl.OPEFOTrainer, which supports "
            "more."
        )


def token_factor(rollout: dict, args: GRPOConfig, accumulation: int, num_processes: int) -> torch.Tensor:
    """f_t, (B, T) fp32: the coefficient of A_t grad log pi_t in the gradient of TRL's loss (TRL 1.16
    `GRPOTrainer._compute_loss`) at ratio 1, averaged over the ``num_processes`` ranks, for the tokens of the rollout
    TRL will split into ``args.steps_per_generation`` micro-batches, over ``accumulation`` of which it accumulates
    gradients. Each normalisation is written as `opefo_trl`'s loss mirror writes it: the two agree bit for bit."""
    steps_per_generation = args.steps_per_generation
    rows = len(rollout["advantages"]) // steps_per_generation  # of each micro-batch
    mask = rollout["completion_mask"]
    mask = (mask * rollout["tool_mask"] if "tool_mask" in rollout else mask).float()
    one = torch.ones((), device=mask.device)
    if args.loss_type == "grpo":  # mean over each sequence's tokens, then over the micro-batch's rows
        normaliser = 1.0 / (mask.sum(-1, keepdim=True).clamp(min=1.0) * rows * accumulation)
    elif args.loss_type == "dr_grpo":  # a constant: rows times the longest completion allowed
        normaliser = one / (rows * args.max_completion_length * accumulation)
    elif args.loss_type == "dapo":  # the rollout's token count over all ranks, spread over its micro-batches
        tokens = rollout["num_items_in_batch"].clamp(min=1.0) / num_processes
        normaliser = one / (tokens * accumulation / steps_per_generation)
    else:  # luspo: the sum over each sequence's tokens, mean over the rows
        normaliser = one / (rows * accumulation)
    factor = mask * normaliser / num_processes  # DDP averages the ranks' gradients
    if "importance_sampling_ratio" in rollout:  # vLLM's importance-sampling correction multiplies each token's loss
        factor = factor * rollout["importance_sampling_ratio"]
    return factor.float().expand_as(mask)


@torch.no_grad()
def opefo_weights(logps, entropies, advantages, factor, reduce_sum=lambda sums: sums) -> tuple[torch.Tensor, float]:
    """w_t, (B, T) fp32, and lambda*, from log pi_t, H_t, the (B, T) advantages A_t and f_t of a rollout batch.
    ``reduce_sum`` sums a tensor over ranks (the identity on one process)."""
    logps, entropies = logps.float(), entropies.float()
    unit_flow = -(1.0 - logps.exp()).square() * (logps + entropies)  # u_t, the paper's estimate
    flow = advantages * unit_flow  # d_t
    weighted = factor.double() * flow.double()  # f_t d_t, summed in fp64
    in_loss = factor > 0
    increase = weighted.where(in_loss & (flow > 0), 0.0).sum()  # P
    decrease = -weighted.where(in_loss & (flow < 0), 0.0).sum()  # N
    increase, decrease = reduce_sum(torch.stack([increase, decrease]))
    total = increase + decrease
    lambda_star = float((decrease - increase) / total) if total > 0 else 0.0  # nothing flows: lambda* = 0
    # w_t = 1 + lambda* s_t, s_t = +1 on S+, -1 on S-, 0 where d_t = 0 (its weight stays 1).
    weights = 1.0 + torch.as_tensor(lambda_star, dtype=torch.float32, device=flow.device) * torch.sign(flow)
    return weights, lambda_star


class OPEFOMinimalTrainer(GRPOTrainer):
    """`GRPOTrainer` whose rollouts carry OPEFO's (B, T) advantages."""

    def _generate_and_score_completions(self, inputs):
        rollout = super()._generate_and_score_completions(inputs)
        if not self.model.training:  # evaluation: no update, nothing to balance
            return rollout
        check_args(self.args)
        if "pixel_values" in rollout or "num_images" in rollout:
            raise NotImplementedError("opefo_minimal.py scores text-only rollouts; use opefo_trl.OPEFOTrainer.")
        # log pi_t and H_t of the whole rollout batch, by TRL's scoring function in the micro-batch size TRL trains in
        # (TRL's own old-log-prob pass, when it runs one, computes no entropies).
        completion_ids = rollout["completion_ids"]
        input_ids = torch.cat([rollout["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([rollout["prompt_mask"], rollout["completion_mask"]], dim=1)
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            logps, entropies, _ = self._get_per_token_logps_and_entropies(
                self.model,
                input_ids,
                attention_mask,
                completion_ids.size(1),
                batch_size=self.args.per_device_train_batch_size,
                compute_entropy=True,
            )
        advantages = rollout["advantages"].unsqueeze(1).expand_as(completion_ids).float()  # A_t = A_i, (B, T)
        factor = token_factor(
            rollout, self.args, self.current_gradient_accumulation_steps, self.accelerator.num_processes
        )
        reduce_sum = lambda sums: self.accelerator.reduce(sums, reduction="sum")  # noqa: E731
        weights, lambda_star = opefo_weights(logps, entropies, advantages, factor, reduce_sum)
        rollout["advantages"] = advantages * weights
        self._metrics["train"]["opefo/lambda"].append(lambda_star)
        return rollout


def main() -> None:
    from datasets import load_dataset
    from trl import get_peft_config
    from trl.rewards import accuracy_reward

    parser = TrlParser((ScriptArguments, GRPOConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config()
    check_args(training_args)  # before the model loads
    dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config)
    trainer = OPEFOMinimalTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=accuracy_reward,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        peft_config=get_peft_config(model_args),
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)


if __name__ == "__main__":
    main()
