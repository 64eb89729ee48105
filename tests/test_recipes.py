"""The paper-comparison recipes under recipes/: they parse, encode the paper's settings, and train on CPU.

Each model folder holds base.yaml and one file per method naming it as its base; every recipe is checked merged
(`opefo_trl.cli.recipe_files`), as `opefo-train --config` reads it. Every recipe is parsed. The Qwen2.5-Math-7B set
also trains 2 optimizer steps on the tiny model with only the model, data, vLLM, precision, size and tracker keys
overridden (the rest of the recipe as written). The Qwen3-4B-Base set is parse-only:
`test_4b_recipes_differ_from_7b_only_in_model_keys` shows it differs from the 7B set only in keys those runs override
anyway.
"""

import json
import math
import os

import pytest
import yaml

from opefo_trl.cli.recipe_files import load_recipe, read_recipe_chain
from opefo_trl.cli.train import main, parse_args
from opefo_trl.runs import rollout_boundary_period

ROOT = os.path.join(os.path.dirname(__file__), "..", "recipes")
MODELS = {"qwen2.5-math-7b": 3000, "qwen3-4b-base": 8000}  # max completion tokens (the paper's setup)
METHODS = [
    "opefo",
    "grpo",
    "grpo_strict",
    "entropy_reg",
    "clip_higher",
    "clip_cov",
    "kl_cov",
    "par",
    "steer",
    "steer_published",
    "stare",
    "ce_gppo",
]
STRICT = {"opefo", "grpo_strict", "par", "steer", "stare"}  # one optimizer update per rollout batch
TOKEN_METHOD = {m: m for m in ("opefo", "par", "clip_cov", "kl_cov", "steer", "stare", "ce_gppo")}  # others: "grpo"
TOKEN_METHOD["steer_published"] = "steer"
ROLLOUT_COMPLETIONS = 32 * 8
#: Recipes on their authors' schedule rather than the comparison's: (prompts per rollout batch, optimizer steps per
#: rollout batch).
AUTHORS_SCHEDULE = {"steer_published": (512, 16)}
MODEL_KEYS = {
    "model_name_or_path",
    "max_completion_length",
    "vllm_max_model_length",
    "vllm_gpu_memory_utilization",
    "output_dir",
}


def recipe_path(model, method):
    return os.path.join(ROOT, model, f"{method}.yaml")


def num_processes():
    with open(os.path.join(ROOT, "accelerate", "zero3.yaml")) as f:
        return yaml.safe_load(f)["num_processes"]


ALL_RECIPES = [(model, method) for model in MODELS for method in METHODS]


def test_recipe_set_is_complete():
    found = sorted(
        (model, name[: -len(".yaml")])
        for model in os.listdir(ROOT)
        if model in MODELS
        for name in os.listdir(os.path.join(ROOT, model))
        if name.endswith(".yaml") and name != "base.yaml"
    )
    assert found == sorted(ALL_RECIPES)


@pytest.mark.parametrize("model, method", ALL_RECIPES)
def test_each_recipe_is_its_models_base_plus_its_method(model, method):
    """One base per model: a recipe's own keys are the method's (and the schedule's), never the model's."""
    (base, shared), (path, own) = read_recipe_chain(recipe_path(model, method))
    assert os.path.samefile(base, os.path.join(ROOT, model, "base.yaml")) and path == recipe_path(model, method)
    assert "method" in own and "method" not in shared and "output_dir" not in shared
    assert own["output_dir"] == f"runs/{model}/{method}"
    assert not own.keys() & MODEL_KEYS - {"output_dir"}


def test_merged_recipes_keep_the_papers_values():
    """A few merged values pinned (base plus override): a lost override or a base key gone would change them."""
    opefo = load_recipe(recipe_path("qwen2.5-math-7b", "opefo"))
    assert (opefo["method"], opefo["opefo_sides"], opefo["entropy_flow_estimate"]) == ("opefo", "both", "opefo")
    assert (opefo["learning_rate"], opefo["gradient_accumulation_steps"], opefo["max_completion_length"]) == (
        2.83e-6,
        16,
        3000,
    )
    assert "steps_per_generation" not in opefo and opefo["report_to"] == "trackio"
    kl_cov = load_recipe(recipe_path("qwen3-4b-base", "kl_cov"))
    assert (kl_cov["learning_rate"], kl_cov["gradient_accumulation_steps"], kl_cov["steps_per_generation"]) == (
        1e-6,
        2,
        16,
    )
    assert (kl_cov["max_completion_length"], kl_cov["vllm_max_model_length"], kl_cov["epsilon"]) == (8000, 9216, 1e9)
    assert load_recipe(recipe_path("qwen2.5-math-7b", "entropy_reg"))["entropy_coef"] == 1e-3  # base: 0.0
    published = load_recipe(recipe_path("qwen2.5-math-7b", "steer_published"))
    assert (published["per_device_train_batch_size"], published["steps_per_generation"]) == (8, 64)
    sizes = {method: len(load_recipe(recipe_path("qwen2.5-math-7b", method))) for method in METHODS}
    assert sizes == {
        "opefo": 45,
        "grpo": 44,
        "grpo_strict": 43,
        "entropy_reg": 44,
        "clip_higher": 46,
        "clip_cov": 49,
        "kl_cov": 48,
        "par": 46,
        "steer": 47,
        "steer_published": 53,
        "stare": 48,
        "ce_gppo": 49,
    }


@pytest.mark.parametrize("model, method", ALL_RECIPES)
def test_recipe_parses_with_the_papers_settings(model, method):
    # use_cpu: bf16 is refused on a machine without a bf16 GPU unless training is explicitly on the CPU.
    # report_to none: the recipes log to trackio, which these tests neither install nor want.
    argv = ["--config", recipe_path(model, method), "--use_cpu", "true", "--report_to", "none"]
    script_args, args, model_args = parse_args(argv)
    gpus = num_processes()
    assert gpus == 8

    # 32 prompts x 8 responses per rollout batch on 8 GPUs (the authors' schedule: their prompts and steps).
    assert args.num_generations == 8
    completions_per_update = args.per_device_train_batch_size * gpus * args.gradient_accumulation_steps
    rollout_completions = args.per_device_train_batch_size * gpus * args.steps_per_generation
    if method in AUTHORS_SCHEDULE:
        prompts, updates = AUTHORS_SCHEDULE[method]
        assert rollout_completions == prompts * 8 and completions_per_update * updates == rollout_completions
        assert args.steps_per_generation == updates * args.gradient_accumulation_steps
        assert args.learning_rate == pytest.approx(1e-6)
    elif method in STRICT:
        assert rollout_completions == completions_per_update == ROLLOUT_COMPLETIONS
        assert args.steps_per_generation == args.gradient_accumulation_steps
        assert args.learning_rate == pytest.approx(2.83e-6)
    else:
        assert rollout_completions == completions_per_update * 8 == ROLLOUT_COMPLETIONS
        assert args.steps_per_generation == 8 * args.gradient_accumulation_steps
        assert args.learning_rate == pytest.approx(1e-6)
    assert args.num_iterations == 1

    assert args.method == TOKEN_METHOD.get(method, "grpo")
    assert args.max_completion_length == MODELS[model]
    assert (args.temperature, args.beta, args.loss_type) == (1.0, 0.0, "dapo")
    assert args.entropy_coef == (1e-3 if method == "entropy_reg" else 0.0)
    # Clip-Cov: the authors' eps_low = eps_high = 1; KL-Cov: no PPO clipping at all.
    epsilon_high = {"clip_higher": 0.28, "clip_cov": 1.0, "kl_cov": 1e9, "ce_gppo": 0.2, "steer_published": 0.28}
    assert args.epsilon_high == epsilon_high.get(method)
    assert args.epsilon == {"clip_cov": 1.0, "kl_cov": 1e9}.get(method, 0.2)
    if method == "clip_cov":
        assert (args.clip_cov_ratio, args.clip_cov_lb, args.clip_cov_ub) == (2e-4, 1.0, 5.0)
    if method == "kl_cov":
        assert (args.kl_cov_ratio, args.kl_cov_coef) == (2e-3, 1.0)
    # The dual clip of the authors' code (clip_ratio_c 10) where their schedule is taken.
    assert args.delta == (10.0 if method in ("ce_gppo", "steer_published") else None)
    if method in ("steer", "steer_published"):
        assert (args.steer_mapping, args.steer_weight_min, args.steer_omega_floor) == ("exp", 0.8, 0.02)
        assert args.entropy_flow_estimate == "opefo"
        published = method == "steer_published"
        assert (args.steer_omega, args.steer_scope) == (
            ("published", "micro_batch") if published else ("entropy_flow", "rollout_batch")
        )
        assert args.per_device_train_batch_size == (8 if published else 2)  # the authors' micro-batch: 8 sequences
    if method == "stare":
        assert (args.stare_variant, args.stare_top_ratio, args.stare_target_entropy) == ("O1", 0.1, 0.3)
        assert (args.stare_weight_positive, args.stare_weight_negative) == (1.1, 0.9)
    if method == "ce_gppo":  # the CE-GPPO scripts: clip 0.2 on both sides, beta1 0.75, beta2 1
        assert (args.ce_gppo_beta1, args.ce_gppo_beta2) == (0.75, 1.0)
    if method == "par":
        assert (args.par_coef, args.par_coef_init, args.par_entropy_target, args.par_coef_step) == (
            None,
            0.0,
            0.2,
            0.05,
        )
    assert args.use_vllm and args.vllm_mode == "colocate"
    assert args.bf16 and args.logging_steps == 1 and args.num_train_epochs == 1 and args.save_steps > 0
    assert args.save_steps % rollout_boundary_period(args) == 0  # every checkpoint at a rollout boundary: resumable
    assert args.optim.startswith("adamw") and args.entropy_flow_diagnostics
    assert script_args.dataset_name == "dapo-math-17k" and script_args.reward_funcs == ["math_accuracy_reward"]
    assert (
        model_args.model_name_or_path
        == {"qwen2.5-math-7b": "Qwen/Qwen2.5-Math-7B", "qwen3-4b-base": "Qwen/Qwen3-4B-Base"}[model]
    )
    if model == "qwen2.5-math-7b":  # context 4096 = up to 1096 prompt tokens + 3000 completion tokens
        assert args.vllm_max_model_length == 4096


@pytest.mark.parametrize("method", METHODS)
def test_4b_recipes_differ_from_7b_only_in_model_keys(method):
    small = load_recipe(recipe_path("qwen2.5-math-7b", method))
    large = load_recipe(recipe_path("qwen3-4b-base", method))
    assert small.keys() == large.keys()
    assert {key for key in small if small[key] != large[key]} <= MODEL_KEYS


def test_readme_lists_every_recipe_and_launch_mode():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    for model, method in ALL_RECIPES + [(SMALL_MODEL, method) for method in SMALL_METHODS]:
        assert f"{model}/{method}.yaml" in readme
    for needle in (
        "vllm_mode: colocate",
        "trl vllm-serve",
        "--vllm_mode server",
        "accelerate/zero3.yaml",
        "accelerate/deepspeed_zero3.json",
        "--resume_from_checkpoint",
        "--num_machines 2",  # two nodes; tests/test_recipes_accelerate.py parses every launch command
        "--vllm_server_base_url",
        "grad_accum_dtype",
        "communication_data_type",
        "base: base.yaml",
        "--report_to none",
    ):
        assert needle in readme, needle


# ----------------------------------------------------------------------------------------------------------------------
# Two optimizer steps per recipe on the tiny model
# ----------------------------------------------------------------------------------------------------------------------

METHOD_METRICS = {
    "opefo": ["opefo/weighted_net"],
    "par": ["par/coef", "par/entropy"],
    "clip_cov": ["clip_cov/dropped_frac"],
    "kl_cov": ["kl_cov/penalised_frac"],
    "steer": ["steer/weight_mean", "steer/floor_frac", "steer/omega_max"],
    "steer_published": ["steer/weight_mean", "steer/floor_frac", "steer/omega_max"],
    "stare": ["stare/gate_on", "stare/entropy", "stare/positive_frac", "stare/negative_frac"],
    "ce_gppo": ["ce_gppo/low_frac", "ce_gppo/high_frac"],
    "entropy_reg": ["entropy_coef"],
}
FLOW_METRICS = [
    "entropy_flow/lambda",
    "entropy_flow/increase",
    "entropy_flow/decrease",
    "entropy_flow/net",
    "entropy_flow/increase_token_frac",
    "entropy_flow/decrease_token_frac",
]


@pytest.mark.parametrize("method", METHODS)
def test_7b_recipe_trains_two_steps_on_cpu(method, tiny_model_path, problems_file, tmp_path):
    recipe = recipe_path("qwen2.5-math-7b", method)
    written = load_recipe(recipe)
    out = str(tmp_path / method)
    if written.get("steps_per_generation"):  # keep the recipe's updates per rollout (8 or 16) of 2 completions
        ratio = written["steps_per_generation"] // written["gradient_accumulation_steps"]
        sizes = [
            "--per_device_train_batch_size",
            "2",
            "--gradient_accumulation_steps",
            "1",
            "--steps_per_generation",
            str(ratio),
        ]
    else:  # one update per rollout of 2 x 2 completions
        sizes = ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"]
    exit_status = main(
        [
            "--config",
            recipe,
            "--model_name_or_path",
            tiny_model_path,
            "--dataset_files",
            problems_file,
            "--output_dir",
            out,
            "--use_vllm",
            "false",
            "--bf16",
            "false",
            "--use_cpu",
            "true",
            "--num_generations",
            "2",
            "--max_completion_length",
            "8",
            "--max_steps",
            "2",
            "--report_to",
            "none",
            *sizes,
        ]
    )
    assert exit_status == 0
    with open(os.path.join(out, "metrics.jsonl")) as f:
        steps = [m for m in map(json.loads, f) if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert math.isfinite(m["loss"]) and m["learning_rate"] == pytest.approx(written["learning_rate"])
        for key in FLOW_METRICS + METHOD_METRICS.get(method, []):
            assert key in m and math.isfinite(m[key]), key
    # Rewards are logged when a rollout batch is generated: step 1 (8-update recipes reuse it for step 2).
    assert 0.0 <= steps[0]["rewards/math_accuracy_reward/mean"] <= 1.0
    if method == "entropy_reg":
        assert steps[0]["entropy_coef"] == pytest.approx(written["entropy_coef"])
    assert os.path.isfile(os.path.join(out, "model.safetensors"))


# ----------------------------------------------------------------------------------------------------------------------
# The small-model recipes: SmolLM2-135M-Instruct on a CPU (tests/real_model/test_real_small_recipe.py trains one)
# ----------------------------------------------------------------------------------------------------------------------

SMALL_MODEL = "smollm2-135m-instruct"
SMALL_METHODS = ["opefo", "grpo"]


def test_every_recipe_folder_is_checked_here():
    folders = {name for name in os.listdir(ROOT) if os.path.isdir(os.path.join(ROOT, name))}
    assert folders == {*MODELS, SMALL_MODEL, "accelerate"}
    found = sorted(name for name in os.listdir(os.path.join(ROOT, SMALL_MODEL)) if name.endswith(".yaml"))
    assert found == sorted(["base.yaml", *(f"{method}.yaml" for method in SMALL_METHODS)])


@pytest.mark.parametrize("method", SMALL_METHODS)
def test_small_model_recipe_is_its_base_plus_its_method_and_fits_a_cpu(method):
    (base, shared), (path, own) = read_recipe_chain(recipe_path(SMALL_MODEL, method))
    assert os.path.samefile(base, os.path.join(ROOT, SMALL_MODEL, "base.yaml"))
    assert "method" in own and "method" not in shared and own["output_dir"] == f"runs/{SMALL_MODEL}/{method}"
    assert not own.keys() & MODEL_KEYS - {"output_dir"}
    script_args, args, model_args = parse_args(["--config", recipe_path(SMALL_MODEL, method)])
    assert args.method == method and model_args.model_name_or_path == "HuggingFaceTB/SmolLM2-135M-Instruct"
    # 8 prompts x 4 completions of <= 40 tokens per optimizer step, strictly on-policy, on one CPU process.
    assert (args.num_generations, args.max_completion_length, args.temperature) == (4, 40, 0.7)
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 8 * 4
    assert args.steps_per_generation == args.gradient_accumulation_steps and args.num_iterations == 1
    assert args.use_cpu and not args.use_vllm and not args.bf16 and args.learning_rate == pytest.approx(5e-6)
    assert (script_args.dataset_name, script_args.math_reward_mode) == ("gsm8k", "strict")
    # The data file is named relative to the repository root, where the recipe is run from.
    (data,) = script_args.dataset_files
    assert os.path.isfile(os.path.join(ROOT, "..", data))


def test_small_model_word_problems_are_what_their_script_writes():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "make_word_problems", os.path.join(ROOT, SMALL_MODEL, "make_word_problems.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # the script writes what the package's generator gives, which it imports
    with open(os.path.join(ROOT, SMALL_MODEL, "word_problems.jsonl")) as f:
        assert [json.loads(line) for line in f] == module.gsm8k_rows()
