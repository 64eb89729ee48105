"""examples/opefo_minimal.py: the single-file OPEFO computes the library's lambda*, weights and (B, T) advantages bit
for bit, refuses what it does not compute, and trains."""

import importlib.util
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer

sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))  # trainer_setup: the trainer tests' helpers
from trainer_setup import base_settings, logged, make_config, make_trainer, spy  # noqa: E402

from opefo_trl.testing import vllm_generation_emulated  # noqa: E402

EXAMPLE = Path(__file__).parents[2] / "examples" / "opefo_minimal.py"


def _load():
    spec = importlib.util.spec_from_file_location("opefo_minimal", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


opefo_minimal = _load()


def _copied(batch: dict) -> dict:
    return {key: value.clone() if torch.is_tensor(value) else value for key, value in batch.items()}


@pytest.mark.parametrize(
    "loss_type, accumulation, vllm_correction",
    [(loss_type, 2, False) for loss_type in opefo_minimal.LOSS_TYPES] + [("dapo", 4, False), ("grpo", 2, True)],
)
def test_lambda_weights_and_advantages_equal_the_librarys_bit_for_bit(
    tiny_model_path, tiny_dataset, length_reward, tmp_path, loss_type, accumulation, vllm_correction
):
    """One fixed rollout batch (TRL's, generated once, its completions cut to varied lengths), handed over by TRL to
    the example's trainer and to OPEFOTrainer: the same lambda*, weights and (B, T) advantages, bit for bit (the same
    float32 and float64 operations on the same log pi_t and H_t). Both score the whole rollout with TRL's scoring
    function in micro-batches of TRL's size: OPEFOTrainer does so where neither TRL's pass nor generation's logits
    serve (vLLM without TRL's pass), so its generation-logits source is switched off here. With vLLM's correction,
    f_t carries TRL's importance ratio."""
    overrides = dict(loss_type=loss_type, gradient_accumulation_steps=accumulation, per_device_train_batch_size=4)
    library = make_trainer(tiny_model_path, tiny_dataset, length_reward, make_config(tmp_path, **overrides))
    example_args = GRPOConfig(**base_settings(tmp_path / "example", **overrides))
    example = make_trainer(
        tiny_model_path, tiny_dataset, length_reward, example_args, trainer_class=opefo_minimal.OPEFOMinimalTrainer
    )
    for trainer in (library, example):
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = accumulation
    inputs = next(iter(library.get_train_dataloader()))
    if vllm_correction:
        emulated = vllm_generation_emulated(library)
        example.use_vllm = example.vllm_importance_sampling_correction = True
    else:
        emulated = mock.patch.object(library.rollout, "generation", None)  # TRL's scoring function instead
    with emulated, torch.no_grad():
        rollout = GRPOTrainer._generate_and_score_completions(library, inputs)
    assert ("importance_sampling_ratio" in rollout) == vllm_correction
    _end_early(rollout)
    library_weights, example_weights = [], []
    spy(library.token_method, "rollout_weights", _recorded(library_weights))
    with mock.patch.object(library.rollout, "generation", None):
        with mock.patch.object(GRPOTrainer, "_generate_and_score_completions", lambda self, _: _copied(rollout)):
            library_output = library._generate_and_score_completions(inputs)
            weigh = _recorded(example_weights)
            with mock.patch.object(opefo_minimal, "opefo_weights", lambda *a: weigh(opefo_minimal_weights, *a)):
                example_output = example._generate_and_score_completions(inputs)

    ((library_decided,), (example_result,)) = library_weights, example_weights
    weights, lambda_star = example_result
    assert lambda_star == library.token_method.lambda_star and lambda_star != 0.0
    assert list(example._metrics["train"]["opefo/lambda"]) == [lambda_star]
    assert torch.equal(weights, library_decided.weights)
    assert example_output["advantages"].shape == rollout["completion_mask"].shape
    assert torch.equal(example_output["advantages"], library_output["advantages"])


def _end_early(rollout: dict) -> None:
    """Completions of 5 to 12 tokens (the tiny model's all run to max_completion_length=12), as if each had ended
    there: grpo's f_t, 1 / |o_i|, then differs between them."""
    mask = rollout["completion_mask"]
    lengths = 5 + torch.arange(len(mask)) % 8
    mask.mul_((torch.arange(mask.size(1)) < lengths[:, None]).to(mask.dtype))
    rollout["num_items_in_batch"] = mask.sum()


def _recorded(results: list):
    """``record(original, *args)``: calls the original and keeps what it returned."""

    def record(original, *args, **kwargs):
        results.append(original(*args, **kwargs))
        return results[-1]

    return record


opefo_minimal_weights = opefo_minimal.opefo_weights


@pytest.mark.parametrize(
    "overrides, named",
    [
        (dict(loss_type="bnpo"), "loss_type='bnpo'"),
        (dict(loss_type="cispo"), "loss_type='cispo'"),
        (dict(num_iterations=2), "num_iterations=2"),
        (dict(gradient_accumulation_steps=2, steps_per_generation=4), "steps_per_generation=4"),
        (dict(top_entropy_quantile=0.2), "top_entropy_quantile=0.2"),
        (dict(importance_sampling_level="sequence"), "importance_sampling_level='sequence'"),
    ],
)
def test_what_the_example_does_not_compute_is_refused_naming_the_option(tmp_path, overrides, named):
    args = GRPOConfig(**base_settings(tmp_path, **overrides))
    with pytest.raises(ValueError, match=f"this configuration has {named}"):
        opefo_minimal.check_args(args)


def test_the_example_trains_and_logs_lambda(tiny_model_path, tiny_dataset, length_reward, tmp_path):
    """Two optimizer steps of the example's trainer: a finite loss and one lambda* per rollout batch, in [-1, 1]."""
    args = GRPOConfig(**base_settings(tmp_path, gradient_accumulation_steps=2, per_device_train_batch_size=4))
    trainer = make_trainer(
        tiny_model_path, tiny_dataset, length_reward, args, trainer_class=opefo_minimal.OPEFOMinimalTrainer
    )
    trainer.train()
    lambdas, losses = logged(trainer, "opefo/lambda"), logged(trainer, "loss")
    assert len(lambdas) == 2 and all(-1.0 <= value <= 1.0 for value in lambdas) and any(lambdas)
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))


def test_the_script_prints_trls_options():
    result = subprocess.run([sys.executable, str(EXAMPLE), "--help"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "--model_name_or_path" in result.stdout and "--loss_type" in result.stdout
