"""The README's CPU drop-in example, run as it is written there (read from README.md, so the two cannot drift)."""

import math
import os
import re

README = os.path.join(os.path.dirname(__file__), "..", "README.md")
MARKER = "<!-- CPU example: tests/test_readme.py runs the next code block -->"


def readme_cpu_example() -> str:
    with open(README, encoding="utf-8") as f:
        text = f.read()
    assert text.count(MARKER) == 1, f"README.md must hold the marker {MARKER!r} once, right above the CPU example"
    block = re.match(r"\s*```python\n(.*?)\n```", text.split(MARKER, 1)[1], re.DOTALL)
    assert block is not None, "the CPU example's marker must be followed by a ```python block"
    return block.group(1)


def test_the_readme_cpu_example_trains_one_step_offline(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the example writes ./tiny-qwen2 and ./tiny-opefo
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    namespace: dict = {}
    exec(compile(readme_cpu_example(), "README.md (CPU example)", "exec"), namespace)
    trainer = namespace["trainer"]
    assert trainer.state.global_step == 1 and (tmp_path / "tiny-qwen2" / "config.json").exists()
    logged = trainer.state.log_history[-2]
    # lambda* balances the logged flows: S+ (1 + lambda) = S- (1 - lambda).
    increase, decrease, lam = (
        logged["entropy_flow/increase"],
        logged["entropy_flow/decrease"],
        logged["entropy_flow/lambda"],
    )
    assert (
        increase > 0 and decrease > 0 and math.isclose(lam, (decrease - increase) / (decrease + increase), rel_tol=1e-5)
    )
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(lam)


def test_the_first_screen_holds_the_make_commands_the_pitch_the_install_and_the_drop_in():
    """A TRL user's first 25 lines: the two `make` commands first (compact), then the paper, `pip install` and the
    drop-in code, whole; its imports name what the package has."""
    with open(README, encoding="utf-8") as f:
        first = f.read().splitlines()[:25]
    text = "\n".join(first)
    before_the_pitch = first[: next(i for i, line in enumerate(first) if line.startswith("**"))]
    commands = [line for line in before_the_pitch if line.strip() and not line.startswith("#")]
    assert [c.split("#")[0].strip() for c in commands] == ["make demo", "make test"]
    assert "arXiv 2605.11491" in text and "pip install" in text
    block = re.search(r"```python\n(.*?)\n```", text, re.DOTALL)
    assert block is not None, "the drop-in code must open and close within the README's first 25 lines"
    code = block.group(1)
    assert "from trl import GRPOConfig, GRPOTrainer" in code and "OPEFOTrainer(" in code and "trainer.train()" in code
    compile(code, "README.md (drop-in)", "exec")
    imports = "\n".join(line for line in code.splitlines() if line.startswith("from "))
    exec(compile(imports, "README.md (drop-in imports)", "exec"), {})


def test_the_readme_names_the_pinned_versions_the_tests_install():
    """The README's tested versions are those `make install` pins (constraints.txt), so the two cannot drift."""
    root = os.path.join(os.path.dirname(__file__), "..")
    with open(os.path.join(root, "constraints.txt"), encoding="utf-8") as f:
        pins = dict(line.strip().split("==") for line in f if "==" in line and not line.startswith("#"))
    with open(README, encoding="utf-8") as f:
        tested = f.read().split("Tested versions", 1)[1].split("\n\n", 1)[0]
    names = {"TRL": "trl", "transformers": "transformers", "accelerate": "accelerate", "datasets": "datasets",
             "DeepSpeed": "deepspeed", "PEFT": "peft", "math-verify": "math-verify"}  # fmt: skip
    for shown, package in names.items():
        assert f"{shown} {pins[package]}" in " ".join(tested.split()), (shown, pins[package])
