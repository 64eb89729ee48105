"""opefo_trl.trainer.parts: which parts a configuration gets, and what is checked against the model when they are
built."""

import pytest
from trainer_setup import logged, make_config, make_trainer, spy

from opefo_trl.trainer.token_weights import micro_batch_state


@pytest.mark.parametrize(
    "settings, rollout, param",
    [
        (dict(method="grpo"), False, False),  # diagnostics from the loss forward only
        (dict(method="opefo"), True, False),
        (dict(method="opefo", entropy_flow_estimate="param"), True, True),
    ],
)
def test_a_configuration_gets_the_parts_it_needs(
    tiny_model_path, tiny_dataset, length_reward, tmp_path, settings, rollout, param
):
    trainer = make_trainer(tiny_model_path, tiny_dataset, length_reward, make_config(tmp_path, **settings))
    assert (trainer.rollout is not None) == rollout and (trainer.param_estimate is not None) == param
    assert trainer.audit in trainer.callback_handler.callbacks


@pytest.mark.parametrize(
    "settings, source, extra_forwards",
    [
        (dict(gradient_accumulation_steps=1), "the training forward (one micro-batch", 0),
        (dict(gradient_accumulation_steps=2, per_device_train_batch_size=4), "generation's logits", 0),
        (
            dict(gradient_accumulation_steps=2, per_device_train_batch_size=4, num_iterations=2, allow_off_policy=True),
            "TRL's own no-grad",
            0,
        ),
    ],
    ids=["one_micro_batch", "generation", "trl_pass"],
)
def test_the_run_says_once_where_lambda_stars_inputs_come_from_and_runs_no_pass_it_does_not_name(
    tiny_model_path, tiny_dataset, length_reward, tmp_path, caplog, settings, source, extra_forwards
):
    import logging

    from trainer_setup import spy

    with caplog.at_level(logging.INFO, logger="opefo_trl"):
        trainer = make_trainer(
            tiny_model_path, tiny_dataset, length_reward, make_config(tmp_path, method="opefo", max_steps=1, **settings)
        )
    said = [r.getMessage() for r in caplog.records if "log pi and entropy come from" in r.getMessage()]
    assert len(said) == 1 and source in said[0] and trainer.scores_source.startswith(source)
    own_passes = []
    spy(trainer.scorer, "score", lambda score, *a, **k: own_passes.append(1) or score(*a, **k))
    trainer.train()
    assert len(own_passes) == extra_forwards
    assert (
        make_trainer(tiny_model_path, tiny_dataset, length_reward, make_config(tmp_path, method="grpo")).scores_source
        is None
    )  # no rollout pass: nothing to say


def test_a_one_micro_batch_rollout_that_trl_scores_takes_lambda_star_from_trls_pass(
    tiny_model_path, tiny_dataset, length_reward, tmp_path
):
    """vLLM with importance-sampling correction and one micro-batch per rollout: lambda*'s log pi and H are TRL's own
    old-log-prob pass (asked for the entropy, which TRL's fused head computes with the log-probs), and the weights
    are set before the training forward; the trainer runs no pass of its own."""
    import inspect
    from unittest import mock

    import torch
    from trl import GRPOTrainer

    from opefo_trl.testing import vllm_generation_emulated

    args = make_config(tmp_path, method="opefo", max_steps=1, use_vllm=True, vllm_importance_sampling_correction=True)
    args.use_vllm = False  # built without vLLM; the rollout below is vLLM's, emulated
    trainer = make_trainer(tiny_model_path, tiny_dataset, length_reward, args)
    scoring = GRPOTrainer._get_per_token_logps_and_entropies
    calls, own_passes, deferred = [], [], []

    def recorded(self, *args, **kwargs):
        bound = inspect.signature(scoring).bind(self, *args, **kwargs)
        calls.append((torch.is_grad_enabled(), bound.arguments.get("compute_entropy", False)))
        return scoring(self, *args, **kwargs)

    spy(trainer.scorer, "score", lambda score, *a, **k: own_passes.append(1) or score(*a, **k))
    spy(
        trainer.micro_batches,
        "loss_call",
        lambda call, inputs: deferred.append(micro_batch_state(inputs).deferred) or call(inputs),
    )
    with (
        vllm_generation_emulated(trainer),
        mock.patch.object(GRPOTrainer, "_get_per_token_logps_and_entropies", recorded),
    ):
        trainer.train()
    assert calls == [(False, True), (True, True)]  # TRL's old-log-prob pass, then the training forward
    assert own_passes == [] and deferred == [False]
    assert (
        len(logged(trainer, "entropy_flow/lambda")) == 1
        and len(logged(trainer, "sampling/importance_sampling_ratio/mean")) == 1
    )


@pytest.mark.parametrize(
    "flags, match",
    [
        (
            dict(aux_loss_enabled=True, router_aux_loss_coef=1e-3),
            r"router's auxiliary loss \(router_aux_loss_coef=0.001",
        ),
        (dict(_entropy_bonus_enabled=True), r"TRL's entropy bonus"),
    ],
    ids=["router_aux_loss", "entropy_bonus"],
)
def test_the_step_balance_refuses_what_trls_own_flags_add_to_the_loss(
    tiny_model_path, tiny_dataset, length_reward, tmp_path, monkeypatch, flags, match
):
    """Decided from the flags TRL's _compute_loss reads (a MoE model's router loss, a bonus switched on however),
    not from one option: TRL's __init__ is made to set them, as it does for a MoE model or the adaptive bonus."""
    from trl import GRPOTrainer

    trl_init = GRPOTrainer.__init__

    def init_with_flags(self, *args, **kwargs):
        trl_init(self, *args, **kwargs)
        for name, value in flags.items():
            setattr(self, name, value)

    monkeypatch.setattr(GRPOTrainer, "__init__", init_with_flags)
    args = make_config(tmp_path, entropy_flow_estimate="param", opefo_balance="step")
    with pytest.raises(ValueError, match=r"opefo_balance='step' .*TRL's training pass would also apply .*" + match):
        make_trainer(tiny_model_path, tiny_dataset, length_reward, args)
    args = make_config(tmp_path, entropy_flow_estimate="param", opefo_balance="batch")
    assert not make_trainer(tiny_model_path, tiny_dataset, length_reward, args).rollout.writes_gradient


def test_sequence_level_importance_sampling_with_opefo_trainer(tiny_model_path, tiny_dataset, length_reward, tmp_path):
    """TRL's test_train_sequence_importance_sampling setting on its own (num_iterations=1): refused by name with the
    default method; plain GRPO trains as TRL's own trainer does, its diagnostics (on by default) switched off with one
    warning."""
    import torch
    from trl import GRPOConfig

    from opefo_trl import OPEFOTrainer

    trl_args = dict(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, num_generations=4,
                    max_completion_length=8, max_steps=1, learning_rate=0.1, use_cpu=True, bf16=False,
                    report_to="none", importance_sampling_level="sequence")  # fmt: skip
    with pytest.raises(ValueError, match=r"importance_sampling_level='sequence' is not modelled by OPEFOTrainer"):
        OPEFOTrainer(tiny_model_path, length_reward, GRPOConfig(**trl_args), train_dataset=tiny_dataset)
    args = GRPOConfig(**trl_args)
    args.method = "grpo"
    with pytest.warns(UserWarning, match=r"importance_sampling_level='sequence'.*switched off for this run"):
        trainer = OPEFOTrainer(tiny_model_path, length_reward, args, train_dataset=tiny_dataset)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert not any(key.startswith("entropy_flow/") for entry in trainer.state.log_history for key in entry)
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
