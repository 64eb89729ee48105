"""The smallest demo budget that still runs every stage of the real code path and learns something: a tiny model
warm-started until it writes digits (so rewards, advantages and flows are not all zero), 2 RL steps per run at the
full learning rate (`--quick true` halves the warm start and keeps at least 2 RL steps), 4 held-out samples."""

import pytest

TINY = dict(
    hidden_size=32,
    num_layers=1,
    warm_start_steps=120,
    warm_start_batch_size=16,
    warmup_steps=0,
    steps=2,
    prompts_per_step=2,
    num_generations=4,
    pass_at_k_samples=4,
    pass_at_k=[1, 4],
)


@pytest.fixture
def tiny_flags() -> list[str]:
    """TINY as command-line flags."""
    flags = []
    for name, value in TINY.items():
        flags += [f"--{name}", *map(str, value if isinstance(value, list) else [value])]
    return flags


@pytest.fixture
def tiny_settings():
    """``DemoSettings`` at the TINY budget, with overrides."""
    from opefo_trl.demo import DemoSettings

    return lambda **overrides: DemoSettings(**{**TINY, **overrides})
