"""opefo_trl.demo.placement: where a policy's entropy sits, measured without touching the run it is measured in."""

import pytest
import torch

from opefo_trl.demo import DemoMethod, train_one, warm_start
from opefo_trl.demo.placement import measure_placement, placement_of
from opefo_trl.demo.settings import START_ENTROPY, demo_methods
from opefo_trl.demo.tasks import TASKS
from opefo_trl.demo.training import build_config


def test_probability_moved_to_other_tokens_keeps_the_task_entropy_and_shows_as_off_task():
    """Two policies with the same digit logits, one with its junk tokens raised: the task-token entropy is the same,
    the full entropy and the off-task probability are higher; masked positions count for nothing."""
    digits = torch.arange(10)
    logits = torch.zeros(1, 2, 40)
    logits[..., :10] = torch.linspace(0, 3, 10)
    junk = logits.clone()
    junk[..., 10:] += 2.0
    junk[0, 1] = 50.0  # a masked position: ignored
    ids, mask = torch.tensor([[3, 12]]), torch.tensor([[True, False]])
    plain, moved = placement_of(logits, ids, mask, digits), placement_of(junk, ids, mask, digits)
    assert moved["task_entropy"] == pytest.approx(plain["task_entropy"], rel=1e-12)
    assert (
        moved["entropy"] > plain["entropy"] + 0.5 and moved["off_task_probability"] > 2 * plain["off_task_probability"]
    )
    assert plain["off_task_sampled"] == 0.0  # the masked off-task token is not counted
    q = torch.softmax(torch.linspace(0, 3, 10, dtype=torch.float64), -1)
    assert plain["task_entropy"] == pytest.approx(float(-(q * q.log()).sum()))


@pytest.mark.slow
def test_measuring_leaves_the_run_as_it_would_be_and_logs_the_start_and_every_kth_step(tmp_path, tiny_settings):
    """A run with the placement measurements every step logs what a run without them logs (the same log
    fingerprint): the measurement samples in a forked random stream. Its rows: step 0 (the warm start) and each
    step; measuring twice with one seed gives the same figures."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import opefo_trl.demo.training as training

    settings = tiny_settings(pass_at_k_samples=0, steps=3)
    model_path = warm_start(str(tmp_path), settings, "threads1", log=lambda _: None)
    method = DemoMethod("grpo", "GRPO", {"method": "grpo"})
    measured = train_one(method, 0, "threads1", model_path, str(tmp_path / "measured"), settings, log=lambda _: None)
    rows = [r for r in __import__("json").load(open(tmp_path / "measured" / "trainer_state.json"))["log_history"]]
    steps = [r["step"] for r in rows if "placement/task_entropy" in r]
    assert steps == [0, 1, 2, 3]  # every = max(1, 3 // 12)
    assert measured.task_entropy_start is not None and measured.off_task_increase_share_final is not None
    original = training.PlacementCallback.on_log
    training.PlacementCallback.on_log = lambda self, *args, **kwargs: None
    try:
        plain = train_one(method, 0, "threads1", model_path, str(tmp_path / "plain"), settings, log=lambda _: None)
    finally:
        training.PlacementCallback.on_log = original
    assert plain.log_fingerprint == measured.log_fingerprint

    task = TASKS[settings.task]
    model, tokenizer = AutoModelForCausalLM.from_pretrained(model_path), AutoTokenizer.from_pretrained(model_path)
    tokens = torch.tensor(task.task_token_ids(tokenizer))
    prompts = [task.prompt(t) for t in task.held_out_targets]
    state = torch.get_rng_state()
    once, twice = (measure_placement(model, tokenizer, prompts, tokens, 4, 6, 1.0, seed=3) for _ in range(2))
    assert once == twice and torch.equal(torch.get_rng_state(), state)
    assert 0.0 <= once["off_task_probability"] <= 1.0 and 0.0 < once["task_entropy"] <= float(
        torch.log(torch.tensor(10.0))
    )


def test_an_entropy_setpoint_method_gets_the_warm_start_s_entropy(tmp_path, tiny_settings):
    settings = tiny_settings()
    methods = demo_methods(settings.entropy_coef)
    for name, field in (
        ("opefo_param_step_setpoint", "opefo_entropy_target"),
        ("entropy_adaptive", "entropy_target"),
        ("stare_start", "stare_target_entropy"),
    ):
        assert methods[name].config[field] == START_ENTROPY
        config = build_config(methods[name], 0, str(tmp_path), settings, list(range(18, 28)), start_entropy=2.2)
        assert getattr(config, field) == 2.2 and config.entropy_flow_task_tokens == list(range(18, 28))
