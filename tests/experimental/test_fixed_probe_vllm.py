"""The fixed probe drawn by vLLM's colocate engine (vLLM's CPU build; `make test-vllm`): it follows from `seed`."""

import sys
from contextlib import nullcontext
from pathlib import Path

import pytest

from opefo_trl import OPEFOConfig
from opefo_trl.experimental.extension_parts import fixed_probe

sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))  # trainer_setup, test_trainer_vllm
from test_trainer_vllm import vllm_settings  # noqa: E402
from trainer_setup import make_trainer, release_vllm  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def completions(probe):
    return [item.batch["completion_ids"].tolist() for item, _ in probe._sample()]


def test_the_fixed_probe_follows_from_seed_under_vllm(
    vllm_model_path, tiny_dataset, length_reward, tmp_path, vllm_cpu_gemm
):
    """The same seed draws the same probe whatever vLLM sampled before (a rollout in between); another seed draws
    another: vLLM's sampler is seeded for the probe, not left to its own stream."""
    args = OPEFOConfig(**vllm_settings(tmp_path, max_completion_length=24))
    trainer = make_trainer(vllm_model_path, tiny_dataset, length_reward, args)
    try:
        prompts = [row["prompt"] for row in tiny_dataset.select(range(4))]
        probe = fixed_probe(trainer, trainer.loss_mirror, prompts)
        first = completions(probe)
        assert len({str(c) for batch in first for c in batch}) > 1  # sampled, not one repeated completion
        trainer.vllm_generation.generate(
            prompts=[[1, 2, 3]] * 8, images=None, num_generations=1, profiler=nullcontext()
        )  # moves vLLM's own random stream on
        assert completions(probe) == first
        probe.seed += 1
        assert completions(probe) != first
    finally:
        release_vllm(trainer)
