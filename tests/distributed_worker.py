"""Run by tests/test_distributed.py under `torchrun --nproc_per_node 2`: trains OPEFO two steps and saves, per
rank, each rollout batch's per-token statistics and the lambda* the rank used."""

import os
import sys

import torch
from datasets import Dataset

from opefo_trl import OPEFOConfig, OPEFOTrainer


def length_reward(completions, **kwargs):
    return [float(len(c[0]["content"]) % 3) for c in completions]


def main(model_path: str, out_dir: str, accumulation: str) -> None:
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
    )
    trainer = OPEFOTrainer(
        model=model_path, reward_funcs=length_reward, args=args, train_dataset=Dataset.from_list(rows)
    )
    records = []
    rollout_weights = trainer.token_method.rollout_weights

    def recording(batch, reduce_sum):
        weights = rollout_weights(batch, reduce_sum)
        records.append(
            dict(
                logps=batch.logps,
                entropies=batch.entropies,
                advantages=batch.advantages,
                mask=batch.mask,
                weights=weights,
                **trainer.token_method.metrics,
            )
        )
        return weights

    trainer.token_method.rollout_weights = recording
    trainer.train()
    rank = trainer.accelerator.process_index
    assert trainer.accelerator.num_processes == 2, "expected two processes"
    torch.save(records, os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    main(*sys.argv[1:4])
