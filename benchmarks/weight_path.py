"""Which package modules one rollout's token weights pass through, from TRL's `_prepare_inputs` to the loss.

One optimizer step of `OPEFOTrainer` on a tiny local model (2 micro-batches of 4 completions), traced with
``sys.setprofile`` from the call of TRL's ``GRPOTrainer._prepare_inputs`` to the return of the first
``OPEFOTrainer.compute_loss``: TRL generates the rollout inside that call (where the trainer weighs it) and splits
it, and the first micro-batch
loss weighs it (the rollout pass) and reads the weights. Every call into a file of ``opefo_trl`` is counted
(dataclass methods Python generates, such as ``__init__``, belong to no file and are not). Two configurations:

- ``recipes``: the recipes' objective (``method="opefo"``, ``entropy_flow_estimate="opefo"``, ``loss_type="dapo"``,
  diagnostics and the audit on) with TRL's vLLM importance-sampling correction, vLLM emulated
  (``opefo_trl.testing.vllm_generation_emulated``: TRL runs its old-log-prob pass and its importance ratio);
- ``param``: the same with ``entropy_flow_estimate="param"`` and ``opefo_balance="step"``.

Reported per configuration: ``modules``, every package module a call entered; ``weight_path``, the same without the
calls made under the reward computation (TRL's ``_calculate_rewards``: the reward functions and their check, upstream
of the advantages, the same for every method, and the check's start and verdict), the audit's bookkeeping
(``ExtensionHooks.after_loss``, which hands the batch to ``EntropyAudit.keep_batch``) and the one-time check of the
loaded weights (``check_finite_policy``);
``entries``, the calls into each module from another file; ``maths_callbacks``, calls from the package's maths
(``MATHS``: ``opefo_trl/maths/`` and the parameter-space maths of ``opefo_trl/experimental/``) into another module of
the package (caller -> callee: count).

    python benchmarks/weight_path.py [recipes|param ...] [--json FILE]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: Calls whose whole subtree is off the weight's path (file inside the package, function name).
OFF_PATH = {
    ("trl", "_calculate_rewards"),  # TRL's: the reward functions, checked (``checks.RewardCheck``)
    ("trainer/checks.py", "start"),  # the reward check's, per rollout
    ("trainer/trainer.py", "_raise_if_a_reward_failed"),
    ("experimental/trainer_hooks.py", "after_loss"),  # the audit's bookkeeping (`EntropyAudit.keep_batch`)
    ("trainer/checks.py", "check_finite_policy"),  # once, before the first generation
    ("trainer/parts.py", "core_model"),  # names the model for that check's message
}
#: The package's maths, torch only and given tensors: files inside the package, or folders ending in "/".
MATHS = (
    "maths/",
    "experimental/optimizer.py",
    "experimental/param_flow.py",
    "experimental/param_jvp.py",
    "experimental/step_model.py",
)
CONFIGURATIONS = {
    "recipes": dict(entropy_flow_estimate="opefo"),
    "param": dict(entropy_flow_estimate="param", opefo_balance="step", entropy_flow_preconditioner="adam"),
}


def _trainer(configuration: str, folder: str) -> Any:
    from datasets import Dataset

    from opefo_trl import OPEFOConfig, OPEFOTrainer
    from opefo_trl.testing import build_tiny_model

    def reward(completions, **kwargs):
        return [float(len(c[0]["content"]) % 3) for c in completions]

    prompts = [{"prompt": [{"role": "user", "content": f"What is {i + 2} + {3 * i + 1}?"}]} for i in range(16)]
    args = OPEFOConfig(
        output_dir=os.path.join(folder, "out"),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_generations=4,
        max_completion_length=12,
        max_steps=1,
        learning_rate=1e-3,
        bf16=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        loss_type="dapo",
        beta=0.0,
        method="opefo",
        entropy_flow_diagnostics=True,
        entropy_flow_audit_steps=10,
        **CONFIGURATIONS[configuration],
    )
    model = build_tiny_model(os.path.join(folder, "model"))
    return OPEFOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(prompts))


def trace(configuration: str) -> dict:
    """The trace of one optimizer step's first micro-batch in ``configuration`` (module docstring)."""
    import opefo_trl
    from opefo_trl.testing import vllm_generation_emulated

    package = os.path.dirname(opefo_trl.__file__) + os.sep
    with tempfile.TemporaryDirectory() as folder:
        trainer = _trainer(configuration, folder)
        modules: collections.Counter[str] = collections.Counter()
        on_path: set[str] = set()
        entries: collections.Counter[str] = collections.Counter()
        callbacks: collections.Counter[str] = collections.Counter()
        state: dict[str, Any] = {"on": False, "done": False, "off_path": []}

        def name(path: str) -> str | None:
            inside = path[len(package) :] if path.startswith(package) else None
            return None if inside == "testing.py" else inside  # the emulated vLLM is the harness's, not the path's

        def profile(frame, event, arg):
            if state["done"] or event not in ("call", "return"):
                return
            here = name(frame.f_code.co_filename)
            function = frame.f_code.co_name
            if not state["on"]:
                trl_file = frame.f_code.co_filename.endswith(os.path.join("trl", "trainer", "grpo_trainer.py"))
                state["on"] = event == "call" and trl_file and function == "_prepare_inputs"
                if not state["on"]:
                    return
            if event == "return":
                if state["off_path"] and state["off_path"][-1] is frame:
                    state["off_path"].pop()
                state["done"] = (here, function) == ("trainer/trainer.py", "compute_loss")
                return
            if (here or ("trl" if "/trl/" in frame.f_code.co_filename else None), function) in OFF_PATH:
                state["off_path"].append(frame)
            if here is None:
                return
            modules[here] += 1
            if not state["off_path"]:
                on_path.add(here)
            caller = name(frame.f_back.f_code.co_filename) if frame.f_back else None
            if caller != here:
                entries[here] += 1
            if caller and caller.startswith(MATHS) and not here.startswith(MATHS):
                callbacks[f"{caller}:{frame.f_back.f_code.co_name} -> {here}:{function}"] += 1

        with vllm_generation_emulated(trainer):
            sys.setprofile(profile)
            try:
                trainer.train()
            finally:
                sys.setprofile(None)
    return {
        "configuration": configuration,
        "modules": sorted(modules),
        "weight_path": sorted(on_path),
        "entries": dict(entries),
        "maths_callbacks": dict(callbacks),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("configurations", nargs="*", choices=[*CONFIGURATIONS, []], help="default: both")
    parser.add_argument("--json", help="also write the traces to this file")
    options = parser.parse_args()
    traces = [trace(configuration) for configuration in options.configurations or CONFIGURATIONS]
    for result in traces:
        print(
            f"{result['configuration']}: {len(result['modules'])} modules entered, "
            f"{len(result['weight_path'])} on the weight's path: {', '.join(result['weight_path'])}; entries "
            f"{result['entries']}; the maths calling other modules: {result['maths_callbacks'] or 'none'}"
        )
    if options.json:
        with open(options.json, "w") as f:
            json.dump(traces, f, indent=1)


if __name__ == "__main__":
    main()
