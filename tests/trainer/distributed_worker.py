"""Run by tests/trainer/test_distributed.py under `torchrun --nproc_per_node 2`: trains OPEFO two steps and saves, per
rank, each rollout batch's per-token statistics, its micro-batches and the lambda the rank used, and the rank's log
history (with a fixed probe of N prompts, also the rank's share of the probe)."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for conftest
from conftest import length_reward  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from opefo_trl import OPEFOConfig, OPEFOTrainer  # noqa: E402
from opefo_trl.testing import keep_rms_norm_in_model_dtype  # noqa: E402
from opefo_trl.trainer.token_weights import micro_batch_state  # noqa: E402

MICRO_BATCH_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "num_items_in_batch")


def main(
    model_path: str,
    out_dir: str,
    accumulation: str,
    estimate: str,
    balance: str,
    loss_type: str,
    dtype: str,
    probe_prompts: str = "0",
):
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {2 * i}?"}]} for i in range(16)]
    args = OPEFOConfig(
        output_dir=os.path.join(out_dir, "run"),
        per_device_train_batch_size=4 // int(accumulation),
        gradient_accumulation_steps=int(accumulation),
        num_generations=4,
        max_completion_length=10,
        max_steps=2,
        logging_steps=1,
        bf16=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        entropy_flow_estimate=estimate,
        opefo_balance=balance,
        loss_type=loss_type,
    )
    probe = [
        {"prompt": [{"role": "user", "content": f"Probe {i}: what is {i} * 3?"}]} for i in range(int(probe_prompts))
    ]
    probe_dataset = Dataset.from_list(probe) if probe else None
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
    if dtype == "float64":
        keep_rms_norm_in_model_dtype(model)
    trainer = OPEFOTrainer(
        model=model,
        processing_class=AutoTokenizer.from_pretrained(model_path),
        reward_funcs=length_reward,
        args=args,
        train_dataset=Dataset.from_list(rows),
        probe_dataset=probe_dataset,
    )
    records, micro_batches = [], []
    weigh, rollout_weights = trainer.rollout.weigh, trainer.token_method.rollout_weights

    def record_micro_batches(batches, **kwargs):
        keep = (*MICRO_BATCH_KEYS, "advantages")
        micro_batches.append([{k: b[k].clone() for k in keep} for b in batches])
        weigh(batches, **kwargs)
        for saved, batch in zip(micro_batches[-1], batches, strict=True):
            state = micro_batch_state(batch)
            if not state.deferred:  # computed for the whole rollout (not deferred to the training forward)
                saved["unit_flow"] = state.unit_flow

    def record_weights(batch, context):
        decided = rollout_weights(batch, context)
        records.append(
            dict(
                micro_batches=micro_batches[-1],
                flow=batch.flow,
                factor=batch.factor,
                logps=batch.logps,
                weights=decided.weights,
                lambda_star=trainer.token_method.lambda_star,
                lambda_applied=decided.lam,
            )
        )
        return decided

    trainer.rollout.weigh = record_micro_batches
    trainer.token_method.rollout_weights = record_weights
    trainer.train()
    rank = trainer.accelerator.process_index
    assert trainer.accelerator.num_processes == 2, "expected two processes"
    torch.save(records, os.path.join(out_dir, f"rank{rank}.pt"))
    torch.save(trainer.state.log_history, os.path.join(out_dir, f"log{rank}.pt"))
    if probe:
        fixed = trainer.param_estimate.fixed_probe.__self__
        sequences = sum(len(item.batch["completion_ids"]) for item, _ in fixed.batches())
        torch.save(dict(prompts=fixed.prompts, sequences=sequences), os.path.join(out_dir, f"probe{rank}.pt"))
    # Leave without interpreter finalization: a gloo worker thread can still be destroying a finished collective (the
    # last barrier holds the all-gathers before it) and needs the GIL for the tensors' Python objects; once Python
    # is finalizing, that thread is unwound through a noexcept destructor and the rank aborts ("terminate called
    # without an active exception", seen in 1 of 58 loaded runs, core dump: ~AsyncBarrierWork -> ~AsyncAllgatherWork
    # -> decref_pyobject -> pthread_exit). destroy_process_group() does not stop those threads while DDP's reducer
    # holds the group (torch 2.13). Upstream: pytorch/pytorch#190489.
    trainer.accelerator.wait_for_everyone()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:9])
