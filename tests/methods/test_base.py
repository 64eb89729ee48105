"""opefo_trl.methods: the registry, a third-party method that plugs in by one class, the settings' checks and the
methods table (one source, the classes; one copy, the README)."""

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from methods_batch import random_batch

from opefo_trl.methods import (
    OPEFO,
    PAR,
    SINGLE_PROCESS,
    TOKEN_METHODS,
    ClipCov,
    KLCov,
    RolloutWeights,
    TokenMethod,
    TokenTerms,
    build_token_method,
    decide_rollout_weights,
    methods_table,
    register_token_method,
    setting,
)


def test_registry_lists_every_method_and_unknown_names_list_the_valid_ones():
    assert set(TOKEN_METHODS) >= {"grpo", "opefo", "par", "clip_cov", "kl_cov", "steer", "stare", "ce_gppo"}
    valid = "ce_gppo, clip_cov, grpo, kl_cov, opefo, par, stare, steer"
    with pytest.raises(ValueError, match=rf"Unknown method 'opfeo'\. Valid methods: {valid}"):
        build_token_method("opfeo")


def test_a_new_method_plugs_in_with_its_own_settings():
    @dataclass
    class ScaleSettings:
        test_scale: float = setting(0.5, "weight of every token")

        def __post_init__(self):
            if self.test_scale < 0:
                raise ValueError("test_scale must be >= 0")

    @register_token_method("_test_scale")
    class Scale(TokenMethod):
        Settings = ScaleSettings

        def micro_batch_terms(self, batch, logps, context=SINGLE_PROCESS):
            return TokenTerms(weights=torch.full_like(batch.logps, self.settings.test_scale))

    try:
        batch = random_batch()
        assert build_token_method("_test_scale").micro_batch_terms(batch, batch.logps).weights.unique().item() == 0.5
        assert Scale(test_scale=0.25).micro_batch_terms(batch, batch.logps).weights.unique().item() == 0.25

        @dataclass
        class Config(ScaleSettings):
            unrelated: int = 3

        assert Scale.from_config(Config(test_scale=0.75)).settings.test_scale == 0.75
        with pytest.raises(ValueError, match=r"test_scale must be >= 0"):
            Scale.from_config(Config(test_scale=-1.0))
        with pytest.raises(ValueError, match=r"reads the settings \['test_scale'\].*OPEFOConfig, ScaleSettings"):
            Scale.from_config(object())
        with pytest.raises(ValueError, match="already registered"):
            register_token_method("_test_scale")(Scale)
    finally:
        TOKEN_METHODS.pop("_test_scale")


def test_settings_are_built_by_keyword_and_a_settings_object_excludes_keywords():
    assert PAR(par_coef=0.3, par_coef_step=0.1).settings == PAR.Settings(par_coef=0.3, par_coef_step=0.1)
    with pytest.raises(TypeError, match="not both"):
        PAR(PAR.Settings(), par_coef=0.3)
    with pytest.raises(TypeError):
        PAR(0.3)  # positional values are refused: a reordered field cannot silently swap settings
    for method in TOKEN_METHODS.values():  # every built-in setting has help text
        assert all(f.metadata.get("help") for f in dataclasses.fields(method.Settings))


@pytest.mark.parametrize(
    "factory,match",
    [
        (lambda: OPEFO(opefo_lambda=1.5), r"\[-1, 1\]"),
        (lambda: OPEFO(opefo_sides="up"), "opefo_sides"),
        (lambda: OPEFO(opefo_lambda_warn=0.0), "opefo_lambda_warn"),
        (lambda: PAR(par_coef=1.2), r"par_coef must lie in \[0, 1\]"),
        (lambda: PAR(par_coef_step=0.0), "par_coef_step"),
        (lambda: ClipCov(clip_cov_ratio=0.0), "clip_cov_ratio"),
        (lambda: ClipCov(clip_cov_lb=5.0, clip_cov_ub=1.0), "clip_cov_lb must be < clip_cov_ub"),
        (lambda: KLCov(kl_cov_ratio=2.0), "kl_cov_ratio"),
        (lambda: KLCov(kl_cov_coef=-1.0), "kl_cov_coef"),
        (lambda: OPEFO(estimate="opefo"), "unexpected keyword"),
    ],
)
def test_invalid_settings_are_rejected(factory, match):
    with pytest.raises((ValueError, TypeError), match=match):
        factory()


# ----------------------------------------------------------------------------------------------------------------------
# The methods table: one source (the method classes), one copy (the README)
# ----------------------------------------------------------------------------------------------------------------------

README = Path(__file__).resolve().parents[2] / "README.md"
TABLE_START, TABLE_END = "<!-- methods table:", "<!-- end of methods table -->"


def test_the_methods_table_lists_every_registered_method_first_the_default():
    table = methods_table()
    rows = table.splitlines()[2:]
    assert rows[0].startswith("| OPEFO (default) |")
    for name in TOKEN_METHODS:  # every method has a row that selects it by name
        assert f'`method="{name}"`' in table, name
    assert "`clip_cov_ratio=0.0002`, `clip_cov_lb=1`, `clip_cov_ub=5`" in table  # the settings' own defaults

    @register_token_method("_test_unlisted")
    class Unlisted(TokenMethod):  # no rows of its own: one naming it, never GRPO's inherited ones
        @dataclass
        class Settings:
            unlisted_strength: float = setting(0.5, "strength")

    try:
        rows = methods_table([Unlisted]).splitlines()[2:]
        assert rows == ['| Unlisted | `method="_test_unlisted"` (`unlisted_strength=0.5`) |']
        assert '`method="_test_unlisted"`' in methods_table()
    finally:
        TOKEN_METHODS.pop("_test_unlisted")


def test_the_readme_holds_the_methods_table_of_the_method_classes():
    text = README.read_text()
    start = text.index("\n", text.index(TABLE_START)) + 1
    copy = text[start : text.index(TABLE_END)].strip()
    assert copy == methods_table(), (
        "README.md's methods table differs from the method classes' rows: replace it with the output of "
        f"`python -m opefo_trl.methods`:\n{methods_table()}"
    )


def test_rollout_weights_say_their_form_and_a_bare_tensor_is_refused():
    """A method's decision is typed: weights of any form, or 1 + lam * signs with lam and signs, or none."""
    signs = torch.tensor([[1.0, -1.0, 0.0]])
    affine = RolloutWeights.affine(-0.25, signs)
    assert affine.weights.tolist() == [[0.75, 1.25, 1.0]] and affine.lam == -0.25 and affine.signs is signs
    assert RolloutWeights(torch.ones(1, 3)).lam is None and RolloutWeights().weights is None
    with pytest.raises(ValueError, match="give lam and signs together"):
        RolloutWeights(torch.ones(1, 3), lam=0.5)
    with pytest.raises(ValueError, match="give the weights 1 \\+ lam \\* signs too"):
        RolloutWeights(lam=0.5, signs=signs)
    batch = random_batch()
    assert decide_rollout_weights(TokenMethod(), batch, SINGLE_PROCESS) == RolloutWeights()

    class BareTensor(TokenMethod):
        def rollout_weights(self, batch, context=SINGLE_PROCESS):
            return torch.ones_like(batch.logps)

    with pytest.raises(TypeError, match=r"BareTensor.rollout_weights returned Tensor; it must return a RolloutWeights"):
        decide_rollout_weights(BareTensor(), batch, SINGLE_PROCESS)
