import warnings

import pytest

from opefo_trl import OPEFOConfig


def config(**overrides):
    return OPEFOConfig(output_dir="unused", bf16=False, use_cpu=True, report_to="none", **overrides)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(method="opfeo"), r"Unknown method 'opfeo'\. Valid methods: .*opefo"),
        (dict(entropy_flow_estimate="exact"), r"Unknown entropy_flow_estimate 'exact'; choose one of"),
        (dict(opefo_lambda=1.5), r"opefo_lambda must lie in \[-1, 1\]"),
        (dict(opefo_lambda=-1.01), r"opefo_lambda must lie in \[-1, 1\]"),
        (dict(opefo_sides="up"), "Unknown opefo_sides"),
        (dict(num_iterations=2), r"strictly on-policy.*num_iterations=2.*allow_off_policy=True"),
        (
            dict(gradient_accumulation_steps=2, steps_per_generation=4),
            r"steps_per_generation=4 != gradient_accumulation_steps=2.*allow_off_policy=True",
        ),
        (dict(method="par", par_coef=2.0), r"par_coef must lie in \[0, 1\]"),
        (dict(method="clip_cov", clip_cov_ratio=0.0), "clip_cov_ratio"),
        (dict(method="clip_cov", clip_cov_lb=5.0, clip_cov_ub=1.0), "clip_cov_lb must be < clip_cov_ub"),
        (dict(method="kl_cov", kl_cov_ratio=-0.1), "kl_cov_ratio"),
        (dict(vocab_stats_vocab_chunk_size=0), "vocab_stats_"),
        (dict(loss_type="dapoo"), r"Unknown loss_type 'dapoo'; choose one of"),
        (dict(vllm_mode="colocat"), r"Unknown vllm_mode 'colocat'"),
        (dict(scale_rewards="grup"), r"Unknown scale_rewards 'grup'"),
        # A setting of a method that is not selected would be silently ignored: refused, naming the method.
        (dict(method="grpo", opefo_sides="up"), r"opefo_sides='up' is a setting of method='opefo'.*no effect"),
        (dict(method="opefo", clip_cov_ratio=0.1), r"clip_cov_ratio=0.1 is a setting of method='clip_cov'"),
        (dict(entropy_flow_preconditioner="sgd"), "Unknown entropy_flow_preconditioner 'sgd'"),
        (dict(entropy_flow_audit_steps=-1), "entropy_flow_audit_steps must be >= 0"),
        (dict(entropy_flow_probe_rollouts=0), "entropy_flow_probe_rollouts must be >= 1"),
        (dict(entropy_flow_probe_rollouts=3), r"entropy_flow_probe_rollouts=3 .*computes no 'param' flow"),
        (
            dict(
                method="grpo",
                entropy_flow_estimate="param",
                entropy_flow_diagnostics=False,
                entropy_flow_probe_rollouts=2,
            ),
            r"computes no 'param' flow",
        ),
        (dict(opefo_entropy_target=1.0), "only opefo_balance='step' solves for"),
        (dict(entropy_flow_task_tokens=[]), r"entropy_flow_task_tokens must be distinct token ids >= 0"),
        (dict(entropy_flow_task_tokens=[3, 3]), r"entropy_flow_task_tokens must be distinct token ids >= 0"),
        (dict(entropy_flow_task_tokens=[-1]), r"entropy_flow_task_tokens must be distinct token ids >= 0"),
        (dict(entropy_flow_entropy="digits"), "Unknown entropy_flow_entropy 'digits'"),
        (
            dict(entropy_flow_estimate="param", entropy_flow_entropy="task_tokens"),
            r"measures the entropy over entropy_flow_task_tokens, which is not set",
        ),
        (
            dict(entropy_flow_entropy="task_tokens", entropy_flow_task_tokens=[1, 2]),
            r"entropy_flow_entropy='task_tokens' .*computes no 'param' flow",
        ),
        (dict(opefo_lambda_warn=0.0), "opefo_lambda_warn must be > 0"),
        (dict(entropy_flow_estimate="full", torch_compile=True), "forward hook, which a compiled model does not run"),
        (dict(entropy_flow_estimate="full", fsdp="full_shard"), "not supported under FSDP"),
        (dict(entropy_flow_estimate="param", fsdp="full_shard"), "not supported under FSDP"),
        (dict(entropy_flow_estimate="param", deepspeed={"zero_optimization": {"stage": 2}}), "DeepSpeed"),
        # The step balance needs the momentum term, which only `param` with the Adam preconditioner measures.
        (dict(opefo_balance="step"), r"opefo_balance='step'.*entropy_flow_estimate='opefo'.*Set entropy_flow_es"),
        (
            dict(opefo_balance="step", entropy_flow_estimate="param", entropy_flow_preconditioner="none"),
            r"entropy_flow_preconditioner='none'",
        ),
        (dict(opefo_balance="step", opefo_lambda=0.001), "fixed opefo_lambda"),
        (dict(opefo_balance="moment"), "Unknown opefo_balance 'moment'"),
        (dict(method="grpo", opefo_balance="step"), r"opefo_balance='step' is a setting of method='opefo'"),
        (dict(opefo_balance="step", entropy_flow_estimate="param", opefo_sides="increase_only"), "opefo_sides='both'"),
        (
            dict(opefo_balance="step", entropy_flow_estimate="param", num_iterations=2, allow_off_policy=True),
            r"opefo_balance='step'.*num_iterations=2.*allow_off_policy does not extend",
        ),
        # TRL's adaptive bonus starts from entropy_coef=0: refused by its own flag.
        (
            dict(opefo_balance="step", entropy_flow_estimate="param", use_adaptive_entropy=True),
            r"opefo_balance='step'.*use_adaptive_entropy=True",
        ),
        # Sequence-level importance sampling moves each token's weight onto its whole sequence: not modelled.
        (dict(importance_sampling_level="sequence"), r"importance_sampling_level='sequence' is not modelled"),
        (dict(method="par", importance_sampling_level="sequence", entropy_flow_diagnostics=False), "'sequence'"),
        (dict(delta=0.9), r"delta=0.9 is not modelled by OPEFOTrainer: TRL's two-sided clip"),
    ],
)
def test_bad_settings_fail_at_configuration_time(overrides, match):
    with pytest.raises(ValueError, match=match):
        config(**overrides)


def test_options_the_factor_does_not_model_are_accepted_where_it_is_not_used():
    """Plain GRPO without the diagnostics is TRL's own update: no factor, nothing to mis-model."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        args = config(method="grpo", entropy_flow_diagnostics=False, importance_sampling_level="sequence", delta=0.9)
    assert args.importance_sampling_level == "sequence"
    assert config(delta=1.5).delta == 1.5  # >= 1: no effect at ratio 1


@pytest.mark.parametrize(
    "overrides,reason",
    [
        (dict(importance_sampling_level="sequence"), "importance_sampling_level='sequence'"),
        (dict(delta=0.9), "delta=0.9"),
    ],
)
def test_plain_grpo_with_an_option_the_diagnostics_cannot_model_switches_them_off_with_one_warning(overrides, reason):
    """The drop-in: what GRPOTrainer trains, method='grpo' trains too; only the diagnostics (on by default), which would
    describe another update, are switched off, with one warning naming the option."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = config(method="grpo", **overrides)
    switched_off = [w for w in caught if "switched off for this run" in str(w.message)]
    assert len(switched_off) == 1 and reason in str(switched_off[0].message)
    assert args.entropy_flow_diagnostics is False


def test_off_policy_opt_in_and_off_policy_baselines():
    assert config(num_iterations=2, allow_off_policy=True).num_iterations == 2
    # Off-policy is the normal setting of the 8-update baselines: no opt-in needed.
    grpo8 = config(method="grpo", gradient_accumulation_steps=1, steps_per_generation=8)
    assert grpo8.steps_per_generation == 8
    assert config(method="clip_cov", num_iterations=2).num_iterations == 2


def test_kl_cov_warns_when_the_config_is_built_that_it_is_inert_on_policy():
    with pytest.warns(UserWarning, match="inert"):
        config(method="kl_cov")
    with pytest.warns(UserWarning, match="no PPO clipping"):
        config(method="kl_cov", gradient_accumulation_steps=1, steps_per_generation=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        config(method="kl_cov", gradient_accumulation_steps=1, steps_per_generation=8, epsilon=1e9, epsilon_high=1e9)


def test_a_built_in_method_is_one_class_and_its_registration():
    import dataclasses

    from opefo_trl.methods import BUILTIN_METHODS, TOKEN_METHODS

    assert [m.name for m in BUILTIN_METHODS] == [
        "grpo",
        "opefo",
        "par",
        "clip_cov",
        "kl_cov",
        "steer",
        "stare",
        "ce_gppo",
    ]
    assert all(TOKEN_METHODS[m.name] is m for m in BUILTIN_METHODS)
    fields = {f.name: f for f in dataclasses.fields(OPEFOConfig)}
    for method in BUILTIN_METHODS:  # its settings are options of OPEFOConfig, with their defaults and help
        for f in dataclasses.fields(method.Settings):
            assert fields[f.name].default == f.default and fields[f.name].metadata["help"] == f.metadata["help"]
    assert config(method="par", par_coef=0.5).par_coef == 0.5


def test_a_method_of_your_own_checks_the_config_it_is_given():
    from dataclasses import dataclass

    from trl import GRPOConfig

    from opefo_trl.methods import TOKEN_METHODS, TokenMethod, register_token_method, setting
    from opefo_trl.trainer.config import with_opefo_settings

    @register_token_method("_test_needs_beta")
    class NeedsBeta(TokenMethod):
        @dataclass
        class Settings:
            needs_beta_scale: float = setting(1.0, "scale")

        @classmethod
        def check_config(cls, args):
            if args.beta == 0:
                raise ValueError("method='_test_needs_beta' needs a KL term: set beta > 0.")

    @dataclass
    class MyConfig(OPEFOConfig, NeedsBeta.Settings):
        pass

    try:
        with pytest.raises(ValueError, match="needs a KL term"):
            MyConfig(output_dir="unused", use_cpu=True, bf16=False, method="_test_needs_beta")
        assert MyConfig(output_dir="unused", use_cpu=True, bf16=False, method="_test_needs_beta", beta=0.1).beta == 0.1
        plain = GRPOConfig(output_dir="unused", use_cpu=True, bf16=False)
        plain.method, plain.needs_beta_scale = "_test_needs_beta", 2.0
        with pytest.raises(ValueError, match="needs a KL term"):  # also on a GRPOConfig given to OPEFOTrainer
            with_opefo_settings(plain)
    finally:
        TOKEN_METHODS.pop("_test_needs_beta")


def test_liger_kernel_is_accepted_since_trl_keeps_the_per_token_path():
    # TRL 1.16 applies only Liger's layer kernels with GRPO (the fused linear cross-entropy stays off), so the
    # per-token log-probs the methods act on are still computed by TRL's fused head.
    assert config(use_liger_kernel=True).use_liger_kernel


def test_every_field_has_help_text():
    import dataclasses

    from trl import GRPOConfig

    new = [f for f in dataclasses.fields(OPEFOConfig) if f.name not in {g.name for g in dataclasses.fields(GRPOConfig)}]
    assert {f.name for f in new} >= {
        "method",
        "entropy_flow_estimate",
        "opefo_lambda",
        "opefo_sides",
        "allow_off_policy",
        "entropy_flow_preconditioner",
        "entropy_flow_audit_steps",
        "opefo_lambda_warn",
        "par_coef",
        "clip_cov_ratio",
        "kl_cov_ratio",
    }
    assert all(f.metadata.get("help") for f in new)


@pytest.mark.parametrize("backend", [dict(torch_compile=True), dict(fsdp="full_shard")])
def test_the_bias_diagnostic_a_backend_cannot_run_is_switched_off_with_one_warning(backend):
    """The bias part of `opefo`'s lambda* needs a vocabulary pass that a compiled model and FSDP do not allow: it is
    switched off with one warning naming why, and the configuration trains (the estimate itself needs no such pass);
    a zero-mean estimate has no bias part to switch off."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = config(**backend)
    said = [w for w in caught if "entropy_flow_bias_diagnostics" in str(w.message)]
    assert len(said) == 1 and "Training goes on" in str(said[0].message)
    assert args.entropy_flow_bias_diagnostics is False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = config(entropy_flow_estimate="sign", **backend)
    assert args.entropy_flow_bias_diagnostics is True
    assert not [w for w in caught if "entropy_flow_bias_diagnostics" in str(w.message)]
