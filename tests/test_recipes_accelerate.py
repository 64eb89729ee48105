"""The accelerate configs under recipes/accelerate/ and the DeepSpeed JSON files they reference.

Each config is taken through accelerate's own launcher code (argument parser, config merging, the environment it
hands to the training processes), with the launch itself replaced by a recorder, then through the code a training
process runs: accelerate's `DeepSpeedPlugin` built from that environment, mixed precision from the recipe, and
transformers' `propagate_args_to_deepspeed` filling the "auto" values from the recipe's arguments. The resulting
DeepSpeed config is parsed by DeepSpeed itself and, in a process of its own, turned into an engine whose dtypes are
checked: bf16 weights, gradients accumulated and reduced in fp32, fp32 master weights and AdamW states.
The launch commands in recipes/README.md are parsed with accelerate's, opefo-train's and `trl vllm-serve`'s parsers.
"""

import json
import os
import re
import shlex
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from accelerate.commands import launch as accelerate_launch
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.utils import DeepSpeedPlugin
from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env
from transformers.integrations.deepspeed import propagate_args_to_deepspeed, unset_hf_deepspeed_config

from opefo_trl.cli.train import parse_args

pytestmark = pytest.mark.slow

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
ACCELERATE = os.path.join(REPO, "recipes", "accelerate")
STRICT_RECIPE = os.path.join(REPO, "recipes", "qwen2.5-math-7b", "opefo.yaml")
README = os.path.join(REPO, "recipes", "README.md")
STRICT_METHODS = {"opefo", "grpo_strict", "par"}  # one optimizer update per rollout batch; the others take 8
# (query heads, key/value heads): vLLM's tensor parallelism must divide both (or be a multiple of the second).
ATTENTION_HEADS = {"Qwen/Qwen2.5-Math-7B": (28, 4), "Qwen/Qwen3-4B-Base": (32, 8)}
ZERO_STAGE = {"zero2.yaml": 2, "zero3.yaml": 3}
ROLLOUT_COMPLETIONS = 32 * 8

# Keys accelerate refuses in an accelerate config that also names a `deepspeed_config_file`
# (DeepSpeedPlugin._deepspeed_config_checks): they belong in the JSON file.
SET_ONLY_IN_THE_JSON = {
    "gradient_accumulation_steps",
    "gradient_clipping",
    "zero_stage",
    "offload_optimizer_device",
    "offload_param_device",
    "offload_param_nvme_path",
    "offload_optimizer_nvme_path",
    "zero3_save_16bit_model",
}
MULTI_NODE = [
    "--num_machines",
    "2",
    "--machine_rank",
    "1",
    "--main_process_ip",
    "10.0.0.1",
    "--main_process_port",
    "29500",
    "--num_processes",
    "16",
]


def deepspeed_json(name):
    """The DeepSpeed JSON file an accelerate config references, as a dict, after checking it exists."""
    config = load_config_from_file(os.path.join(ACCELERATE, name))
    path = config.deepspeed_config["deepspeed_config_file"]
    assert not os.path.isabs(path), "a path relative to the repository root, where the recipes are launched from"
    assert os.path.isfile(os.path.join(REPO, path)), path
    with open(os.path.join(REPO, path)) as f:
        return json.load(f)


def launch(config_name, *launch_args, monkeypatch):
    """`accelerate launch --config_file recipes/accelerate/<config_name> <launch_args> -m opefo_trl.cli.train`
    through accelerate's parser, config merging and launcher set-up, without starting any process.
    Returns the merged arguments (torchrun's per-node settings included) and the training processes' environment."""
    launched = {}

    def record_deepspeed(args):
        launched["cmd"], launched["env"] = prepare_deepspeed_cmd_env(args)
        launched["args"] = args

    def record_multi_gpu(args):
        launched["env"], launched["args"] = prepare_multi_gpu_env(args), args

    monkeypatch.setattr(accelerate_launch, "deepspeed_launcher", record_deepspeed)
    monkeypatch.setattr(accelerate_launch, "multi_gpu_launcher", record_multi_gpu)
    monkeypatch.chdir(REPO)
    argv = ["--config_file", os.path.join(ACCELERATE, config_name), *launch_args, "-m", "opefo_trl.cli.train"]
    accelerate_launch.launch_command(accelerate_launch.launch_command_parser().parse_args(argv))
    return launched["args"], launched["env"]


def training_process_deepspeed_config(env, recipe_args, monkeypatch):
    """The DeepSpeed config a training process ends up with: accelerate's `DeepSpeedPlugin` from the launcher's
    environment with the recipe's mixed precision (what `TrainingArguments` does), then the "auto" values filled from
    the recipe's arguments by the Trainer (`propagate_args_to_deepspeed`)."""
    for key, value in env.items():
        if key.startswith("ACCELERATE_"):
            monkeypatch.setenv(key, value)
    plugin = DeepSpeedPlugin()  # raises if the accelerate config and the JSON file both set a key
    plugin.set_mixed_precision(recipe_args.mixed_precision)
    propagate_args_to_deepspeed(SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin)), recipe_args)
    return plugin, plugin.deepspeed_config


@pytest.fixture(autouse=True)
def no_deepspeed_config_left_behind():
    # transformers keeps a global reference to the last DeepSpeed config it processed (ZeRO-3 makes from_pretrained
    # partition weights while it lives): clear it so that later tests load models normally.
    yield
    unset_hf_deepspeed_config()


@pytest.fixture(scope="module")
def strict_recipe_args():
    # Parsed before any ACCELERATE_* variable is set, so that TrainingArguments builds no DeepSpeed plugin of its own.
    return parse_args(["--config", STRICT_RECIPE, "--use_cpu", "true", "--report_to", "none"])[1]


@pytest.mark.parametrize("name", ["ddp.yaml", "zero2.yaml", "zero3.yaml"])
def test_accelerate_config_parses_with_accelerates_loader(name):
    config = load_config_from_file(os.path.join(ACCELERATE, name))  # accelerate's own loader: rejects unknown keys
    assert config.num_processes == 8 and config.num_machines == 1 and config.machine_rank == 0
    if name == "ddp.yaml":
        assert str(config.distributed_type).endswith("MULTI_GPU") and config.mixed_precision == "bf16"
        return
    assert str(config.distributed_type).endswith("DEEPSPEED")
    # bf16 comes from the recipe's `bf16: true` through the JSON's "auto"; accelerate refuses mixed_precision here.
    assert config.mixed_precision is None
    assert not set(config.deepspeed_config) & SET_ONLY_IN_THE_JSON, config.deepspeed_config
    assert config.deepspeed_config["deepspeed_multinode_launcher"] == "standard"
    assert config.deepspeed_config.get("zero3_init_flag", False) == (name == "zero3.yaml")


@pytest.mark.parametrize("name", ["zero2.yaml", "zero3.yaml"])
def test_deepspeed_json_accumulates_and_reduces_gradients_in_fp32(name):
    ds = deepspeed_json(name)
    assert ds["data_types"]["grad_accum_dtype"] == "fp32"  # DeepSpeed's default: the model dtype (bf16)
    assert ds["communication_data_type"] == "fp32"  # DeepSpeed's default: the model dtype (bf16)
    assert ds["bf16"] == {"enabled": "auto"}  # follows the recipe's `bf16`
    assert "fp16" not in ds
    # Filled from the recipe's arguments by transformers; a number here would have to match them exactly.
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        assert ds[key] == "auto", key
    assert ds["gradient_clipping"] == "auto"
    zero = ds["zero_optimization"]
    assert zero["stage"] == ZERO_STAGE[name] and zero["offload_optimizer"] == {"device": "none"}
    if name == "zero3.yaml":
        assert zero["offload_param"] == {"device": "none"}
        assert zero["stage3_gather_16bit_weights_on_model_save"] is True  # save_model() writes consolidated weights


@pytest.mark.parametrize("name", ["zero2.yaml", "zero3.yaml"])
@pytest.mark.parametrize("nodes", [1, 2])
def test_launch_gives_the_training_processes_an_fp32_gradient_config(name, nodes, strict_recipe_args, monkeypatch):
    pytest.importorskip("deepspeed")  # transformers' DeepSpeed config handling needs it installed
    from deepspeed.runtime.config import DeepSpeedConfig

    args, env = launch(name, *(MULTI_NODE if nodes == 2 else []), monkeypatch=monkeypatch)
    assert args.use_deepspeed and args.mixed_precision == "no"
    assert args.deepspeed_config_file == f"recipes/accelerate/deepspeed_{name[:-5]}.json"
    assert env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] == args.deepspeed_config_file
    assert env.get("ACCELERATE_DEEPSPEED_ZERO3_INIT") == ("true" if name == "zero3.yaml" else None)

    plugin, config = training_process_deepspeed_config(env, strict_recipe_args, monkeypatch)
    assert plugin.zero_stage == ZERO_STAGE[name] and plugin.zero3_init_flag == (name == "zero3.yaml")
    assert config["bf16"] == {"enabled": True} and config["fp16"] == {"enabled": False}
    assert config["train_micro_batch_size_per_gpu"] == 2 and config["gradient_accumulation_steps"] == 16
    assert config["gradient_clipping"] == 1.0

    parsed = DeepSpeedConfig(config)  # DeepSpeed's own parser and sanity checks
    assert parsed.grad_accum_dtype == "fp32" and parsed.communication_data_type == torch.float32
    assert parsed.zero_optimization_stage == ZERO_STAGE[name]
    assert parsed.zero_config.gather_16bit_weights_on_model_save == (name == "zero3.yaml")


@pytest.mark.parametrize("name", ["ddp.yaml", "zero2.yaml", "zero3.yaml"])
def test_configs_accept_the_two_node_launch(name, monkeypatch):
    args, env = launch(name, *MULTI_NODE, monkeypatch=monkeypatch)
    assert (args.num_machines, args.machine_rank, args.num_processes) == (2, 1, 16)
    assert (args.main_process_ip, args.main_process_port) == ("10.0.0.1", 29500)
    # What torchrun runs on this node: 8 processes of 16, node rank 1, rendezvous on the main node.
    assert (args.nproc_per_node, args.nnodes, args.node_rank) == ("8", "2", 1)
    assert (args.rdzv_backend, args.rdzv_endpoint) == ("static", "10.0.0.1:29500")
    assert env["ACCELERATE_MIXED_PRECISION"] == ("bf16" if name == "ddp.yaml" else "no")
    if name != "ddp.yaml":
        assert args.deepspeed_multinode_launcher == "standard"  # torchrun on each node, no pdsh hostfile
        assert env["ACCELERATE_USE_DEEPSPEED"] == "true"


def test_deepspeed_config_file_can_be_given_when_launching_from_elsewhere(monkeypatch):
    absolute = os.path.join(ACCELERATE, "deepspeed_zero3.json")
    args, env = launch("zero3.yaml", "--deepspeed_config_file", absolute, monkeypatch=monkeypatch)
    assert args.deepspeed_config_file == absolute == env["ACCELERATE_DEEPSPEED_CONFIG_FILE"]  # replaces the YAML's


def readme_commands(program):
    """The `program ...` command lines in recipes/README.md's bash blocks as argument lists (continuation lines
    joined; leading VAR=value assignments, comments and a trailing `&` dropped)."""
    with open(README) as f:
        blocks = re.findall(r"```bash\n(.*?)```", f.read(), flags=re.S)
    words_of_program = program.split()
    commands = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                words.pop(0)
            if words[-1:] == ["&"]:
                words.pop()
            if words[: len(words_of_program)] == words_of_program:
                commands.append(words[len(words_of_program) :])
    return commands


def test_readme_vllm_serve_commands_use_trls_flags():
    from trl.scripts.vllm_serve import make_parser

    commands = readme_commands("trl vllm-serve")
    assert len(commands) == 2
    for argv in commands:
        server, unknown = make_parser().parse_args_and_config(argv, return_remaining_strings=True)
        assert unknown == [], unknown  # TRL would hand unknown flags to `vllm serve` unchecked
        heads, kv_heads = ATTENTION_HEADS[server.model]
        tp = server.tensor_parallel_size
        assert heads % tp == 0 and (kv_heads % tp == 0 or tp % kv_heads == 0), argv
        assert server.data_parallel_size == 1 and server.max_model_len == 4096  # the 7B model's context


def test_readme_launch_commands_parse_and_keep_256_completions_per_rollout(monkeypatch):
    """Every `accelerate launch` in recipes/README.md parses with accelerate's parser and opefo-train's, and keeps
    256 completions per rollout batch with one (strict recipes) or eight (the others) optimizer updates each."""
    monkeypatch.chdir(REPO)
    commands = readme_commands("accelerate launch")
    assert len(commands) == 5
    for argv in commands:
        launch_args = accelerate_launch.launch_command_parser().parse_args(argv)
        assert launch_args.module and launch_args.training_script == "opefo_trl.cli.train", argv
        processes = launch_args.num_processes or load_config_from_file(launch_args.config_file).num_processes
        if launch_args.num_machines:
            assert processes % launch_args.num_machines == 0
            assert 0 <= launch_args.machine_rank < launch_args.num_machines
        train_argv = launch_args.training_script_args
        # opefo-train's parser: rejects unknown flags
        args = parse_args([*train_argv, "--use_cpu", "true", "--report_to", "none"])[1]
        recipe = os.path.basename(train_argv[train_argv.index("--config") + 1])
        assert args.per_device_train_batch_size * processes * args.steps_per_generation == ROLLOUT_COMPLETIONS, argv
        updates_per_rollout = args.steps_per_generation // args.gradient_accumulation_steps
        assert updates_per_rollout == (1 if recipe[: -len(".yaml")] in STRICT_METHODS else 8), argv
        if args.vllm_mode == "server" and processes == 16:
            assert args.vllm_server_base_url == "http://10.0.0.3:8000"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_deepspeed_engine_accumulates_and_reduces_in_fp32(monkeypatch, tmp_path):
    """DeepSpeed itself, given the config a training process gets, keeps bf16 weights for forward/backward,
    accumulates and reduces gradients in fp32 and keeps fp32 master weights and AdamW states (one rank, seconds)."""
    pytest.importorskip("deepspeed")
    # Two micro-batches per optimizer step (so that gradients are accumulated) on one rank.
    small = ["--gradient_accumulation_steps", "2", "--num_generations", "2"]
    args = parse_args(["--config", STRICT_RECIPE, "--use_cpu", "true", "--report_to", "none", *small])[1]
    files = []
    for name in ("zero2.yaml", "zero3.yaml"):
        _, env = launch(name, monkeypatch=monkeypatch)
        _, config = training_process_deepspeed_config(env, args, monkeypatch)
        files.append(str(tmp_path / f"{name}.json"))
        with open(files[-1], "w") as f:
            json.dump(config, f)
    worker = os.path.join(os.path.dirname(__file__), "deepspeed_precision_worker.py")
    # A plain process (none of the ACCELERATE_* variables set above), one rank on a free port.
    env = {key: value for key, value in os.environ.items() if not key.startswith("ACCELERATE_")}
    env.update(DS_BUILD_OPS="0", OMP_NUM_THREADS="1", MASTER_PORT=str(_free_port()))
    result = subprocess.run(
        [sys.executable, worker, *files], env=env, cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    reports = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    expected = {
        "weights": ["torch.bfloat16"],
        "micro_batch_gradient": ["torch.bfloat16"],
        "gradient_accumulation": ["torch.float32"],
        "gradient_reduction": ["torch.float32"],
        "master_weights": ["torch.float32"],
        "optimizer_states": ["torch.float32"],
    }
    assert reports == [expected, expected]
