"""opefo_trl.trainer.scoring: the hidden states and the LM-head transform the `full` statistics are computed from are
the ones TRL's fused head uses."""

import json

import pytest
import torch
from trainer_setup import float64_reference, make_config, make_trainer

from opefo_trl.trainer.scoring import logit_scale

pytestmark = pytest.mark.numerics


def test_the_full_statistics_see_the_logits_trl_fused_head_sees(tiny_model_path, tiny_dataset, length_reward, tmp_path):
    """Logit scale, softcapping and temperature as TRL's head applies them: the entropy computed from the captured
    hidden states by vocab_stats equals the entropy TRL's kernel returns for the same forward."""
    import shutil

    from trl import GRPOTrainer

    from opefo_trl.maths.vocab_stats import vocab_stats

    path = tmp_path / "scaled"
    shutil.copytree(tiny_model_path, path)
    config = json.loads((path / "config.json").read_text())
    config.update(logit_scale=0.5, final_logit_softcapping=3.0)
    (path / "config.json").write_text(json.dumps(config))
    args = make_config(tmp_path, entropy_flow_estimate="full", temperature=0.7)
    trainer = make_trainer(str(path), tiny_dataset, length_reward, args)
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    with torch.no_grad(), trainer.scorer.capture_hidden_states(True) as chunks:
        _, entropies, _ = GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, trainer.model, ids, mask, 5, compute_entropy=True
        )
    text_config = trainer.scorer.core().config
    assert logit_scale(text_config) == 0.5
    hidden = torch.cat(chunks)[:, -6:-1]
    head = trainer.scorer.core().get_output_embeddings()
    assert trainer.scorer.moments(chunks, 5)[0] is not None
    stats = vocab_stats(hidden, head.weight, head.bias, temperature=0.7, logit_scale=0.5, softcap=3.0)
    torch.testing.assert_close(stats.entropy, entropies, rtol=1e-5, atol=1e-5)
    unscaled = vocab_stats(hidden, head.weight, head.bias, temperature=0.7)
    assert not torch.allclose(unscaled.entropy, entropies, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(
    "attributes,expected",
    [
        (dict(logit_scale=0.5), 0.5),
        (dict(output_multiplier=2.0), 2.0),
        (dict(lm_head_multiplier=3.0), 3.0),
        (dict(logits_scaling=4.0, model_type="granite"), 0.25),  # Granite divides by it
        (dict(logits_scaling=4.0, model_type="hyperclovax"), 4.0),  # HyperCLOVA X multiplies
        (dict(), 1.0),
    ],
)
def test_logit_scale_lookup_follows_trl(attributes, expected):
    from types import SimpleNamespace

    assert logit_scale(SimpleNamespace(**{"model_type": "qwen2", **attributes})) == expected


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_the_param_jvp_and_the_full_sums_at_a_temperature_are_their_float64_references(
    tiny_model_path, tiny_dataset, length_reward, tmp_path, temperature
):
    """At T != 1, the trainer's forward-mode pass (u_t = d log pi_t, dH_t along a direction of every parameter) against
    a float64 central difference of an independent float64 copy of the model (RMSNorm kept in float64), and its `full`
    vocabulary sums against that copy's float64 softmax of logits / T. Measured at T = 0.7 (max |u| 45): the difference
    falls as step^2 down to step 1e-5 (1.6e-1, 1.6e-3, 1.6e-5 at 1e-3, 1e-4, 1e-5: truncation) and at step 1e-6 is
    5e-6 for a float64 trainer and 1.5e-5 for this float32 one (~3e-7 relative: the float32 backbone's rounding). The
    bounds are 1e-4 of the largest value; a pass at T = 1 is off by ~0.3 of it."""
    args = make_config(tmp_path, entropy_flow_estimate="param", temperature=temperature)
    trainer = make_trainer(tiny_model_path, tiny_dataset, length_reward, args)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 300, (3, 5), generator=gen)
    completion = torch.randint(3, 300, (3, 7), generator=gen)
    completion_mask = torch.ones_like(completion)
    completion_mask[0, 5:] = 0
    batch = dict(prompt_ids=prompt, prompt_mask=torch.ones_like(prompt), completion_ids=completion,
                 completion_mask=completion_mask)  # fmt: skip
    named = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
    direction = {n: torch.randn(p.shape, generator=gen) for n, p in named}
    u, dH = trainer.scorer.jvp(batch, [p for _, p in named], [direction[n] for n, _ in named])
    step = 1e-6
    up = float64_reference(tiny_model_path, batch, temperature, direction, step)
    down = float64_reference(tiny_model_path, batch, temperature, direction, -step)
    mask = completion_mask.bool()
    for ours, plus, minus in ((u, up[0], down[0]), (dH, up[1], down[1])):
        reference = (plus - minus)[mask] / (2 * step)
        torch.testing.assert_close(ours[mask].double(), reference, rtol=0, atol=1e-4 * reference.abs().max().item())
    scores = trainer.scorer.score(batch, vocab=True)
    reference = float64_reference(tiny_model_path, batch, temperature)
    for ours, theirs in zip((scores.logps, scores.entropies, *scores.moments), reference, strict=True):
        torch.testing.assert_close(ours[mask].double(), theirs[mask], rtol=0, atol=1e-4 * theirs.abs().max().item())
