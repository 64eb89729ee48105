"""Where a step of the `param` estimate spends its time on the real SmolLM2-135M-Instruct (30 layers).

One `OPEFOTrainer` run with ``entropy_flow_estimate="param"`` under ``cProfile``. The time of each phase is the
cumulative time of the function that runs it:

- ``generation``: TRL's sampling (``GRPOTrainer._generate``);
- ``param: gradient passes``: grad Hbar and the loss gradient a, a float32 forward with two backwards
  (``ParamFlowEstimator.add_batch``);
- ``param: forward-mode u_t``: the forward-mode pass (``experimental.param_jvp.completion_jvp``);
- ``param: scoring``: the estimate's own log pi and H in the parameters' precision (``Scorer.score_full_precision``);
- ``param: direction``: the update direction D grad Hbar (``ParamFlowEstimator.direction``);
- ``TRL loss forward`` and ``TRL backward``: the training pass GRPO runs too.

    python benchmarks/profile_param.py [--steps 3] [--completion_length 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: Phase name -> (file name ends with, function name) of the function whose cumulative time is the phase's.
PHASES = {
    "generation": ("trl/trainer/grpo_trainer.py", "_generate"),
    "param: gradient passes": ("opefo_trl/experimental/param_flow.py", "add_batch"),
    "param: forward-mode u_t": ("opefo_trl/experimental/param_jvp.py", "completion_jvp"),
    "param: scoring": ("opefo_trl/trainer/scoring.py", "score_full_precision"),
    "param: direction": ("opefo_trl/experimental/param_flow.py", "direction"),
    "TRL loss forward": ("trl/trainer/grpo_trainer.py", "_compute_loss"),
    "TRL backward": ("accelerate/accelerator.py", "backward"),
}


def profile_param(steps: int = 3, completion_length: int = 64) -> dict[str, float]:
    """Seconds of each phase (:data:`PHASES`) and of the whole run (``total``), over ``steps`` optimizer steps of 8
    completions (2 prompts x 4) of at most ``completion_length`` tokens."""
    from datasets import Dataset

    from opefo_trl import OPEFOConfig, OPEFOTrainer
    from opefo_trl.real_model import smollm2_135m_instruct

    def reward(completions, **kwargs):
        return [float(len(c[0]["content"]) % 3) for c in completions]

    prompts = [{"prompt": [{"role": "user", "content": f"What is {i + 2} + {3 * i + 1}?"}]} for i in range(16)]
    with tempfile.TemporaryDirectory() as folder:
        args = OPEFOConfig(
            output_dir=folder,
            per_device_train_batch_size=8,
            num_generations=4,
            max_completion_length=completion_length,
            max_steps=steps,
            learning_rate=1e-6,
            temperature=0.7,
            loss_type="dapo",
            bf16=False,
            use_cpu=True,
            report_to="none",
            save_strategy="no",
            seed=0,
            disable_tqdm=True,
            method="opefo",
            entropy_flow_estimate="param",
        )
        trainer = OPEFOTrainer(
            str(smollm2_135m_instruct()), reward, args=args, train_dataset=Dataset.from_list(prompts)
        )
        profiler = cProfile.Profile()
        start = time.perf_counter()
        profiler.runcall(trainer.train)
        total = time.perf_counter() - start
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]  # (file, line, name) -> (.., cumulative, ..)
    seconds = {"total": total}
    for phase, (suffix, name) in PHASES.items():
        seconds[phase] = sum(
            entry[3] for (path, _, function), entry in stats.items() if function == name and path.endswith(suffix)
        )
    return seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="Optimizer steps to profile.")
    parser.add_argument("--completion_length", type=int, default=64, help="max_completion_length.")
    parser.add_argument("--threads", type=int, default=2, help="torch threads.")
    options = parser.parse_args(argv)
    import torch

    torch.set_num_threads(options.threads)
    seconds = profile_param(options.steps, options.completion_length)
    total = seconds["total"]
    print(f"{options.steps} steps, {options.threads} threads: {total:.1f} s")
    print("| phase | s | share |\n|---|---|---|")
    for phase in PHASES:
        print(f"| {phase} | {seconds[phase]:.1f} | {seconds[phase] / total:.0%} |")


if __name__ == "__main__":
    main()
