"""opefo_trl.trainer.scoring: the hidden states and the LM-head transform the `full` statistics are computed from are
the ones TRL's fused head uses."""

import json

import pytest
import torch
from trainer_setup import make_config, make_trainer

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
    assert trainer.scorer.vocab_stats(chunks, 5)[0] is not None
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
