"""What TRL and transformers only find out once training runs, checked when it can be.

- :func:`check_training_values`: settings that fail only at the first optimizer step or generation (a negative
  learning rate, no completion tokens, temperature 0, any number option that is inf or nan), refused when the
  trainer is built, before the model loads.
- :func:`check_vllm_setup`: vLLM options the machine at hand cannot run (vLLM not installed, sleep mode or server
  mode's weight transfer without a CUDA GPU, an attention head size vLLM's CPU backend refuses), refused before the
  model loads.
- :func:`check_finite_policy`: a policy whose loaded weights hold NaN or inf (a diverged run's checkpoint), refused
  before the first generation, where sampling would stop with torch's "probability tensor contains inf, nan"
  RuntimeError.
- :class:`RewardCheck`: what reward functions return, checked on every call. A function that raises, returns
  something other than one number (or None) per completion, or a reward that is inf, NaN or too large for TRL's
  float32 group statistics (:func:`largest_reward`) stops training with an
  error that names the function and the first bad value, on every process at once (a reward computed on one process
  only would leave the others waiting in the gather that follows).

Example:
    >>> reward_problem("my_reward", [1.0, "0.5"], 2)  # doctest: +ELLIPSIS
    "Reward function 'my_reward' returned '0.5' (a str) for completion 1 of 2..."
    >>> print(reward_problem("my_reward", [1.0, float("nan"), None], 3))  # doctest: +ELLIPSIS
    Reward function 'my_reward' returned nan for 1 of 3 completions (first: completion 1); ...
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import numbers
import traceback
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from trl.trainer.utils import is_async_callable

from opefo_trl.runs.checkpoint import at_rollout_boundary, rollout_boundary_period, rollout_schedule


class NonFiniteWeightsError(ValueError):
    """The policy's weights hold NaN or inf when training starts (the message names the tensors and what to train
    from instead)."""


def check_finite_policy(model: Any, where: str, resumed: bool, reduce_sum: Callable[[Any], Any], device: Any) -> None:
    """Refuse a policy whose weights hold NaN or inf, on every process at once: each checks the parameters it holds
    (its shard under DeepSpeed ZeRO-3 or FSDP) with :func:`opefo_trl.data.model_files.non_finite_names`, and the
    counts are summed over processes. One pass over the weights, once, before the first generation.

    Args:
        model: The policy, unwrapped (a PEFT model checks its base weights and its adapter).
        where: Where its weights were loaded from: the checkpoint resumed, else the model's name or path.
        resumed: Whether ``where`` is a checkpoint of the run being resumed (what to do instead differs).
        reduce_sum, device: Sum a tensor on ``device`` over processes.
    """
    import torch

    from opefo_trl.data.model_files import non_finite_names, non_finite_weights

    def local(param: Any) -> Any:
        param = getattr(param, "ds_tensor", param)  # DeepSpeed ZeRO-3: this process's partition
        return param.to_local() if hasattr(param, "to_local") else param  # an FSDP2 DTensor: this process's shard

    with torch.no_grad():
        bad = non_finite_names((name, local(param)) for name, param in model.named_parameters())
    count = int(reduce_sum(torch.tensor([float(len(bad))], device=device))[0])
    if not count:
        return
    instead = (
        "Resume from an earlier checkpoint of the run (--resume_from_checkpoint <its folder>), whose weights are "
        "finite, perhaps with a lower learning_rate"
        if resumed
        else "Train from finite weights: the base model, or an earlier checkpoint of the run that wrote these"
    )
    raise NonFiniteWeightsError(
        f"{non_finite_weights(where, bad, count)}: sampling from them fails at the first generation (a probability "
        f"tensor holding NaN), and no update can make them finite again. {instead}."
    )


def non_finite_options(args) -> list[str]:
    """``name=value`` of every number option of ``args`` (a dataclass or a namespace) that is inf or nan, lists of
    numbers included.

    >>> from types import SimpleNamespace
    >>> non_finite_options(SimpleNamespace(learning_rate=float("inf"), reward_weights=[1.0, float("nan")], steps=2))
    ['learning_rate=inf', 'reward_weights=[1.0, nan]']
    """
    if dataclasses.is_dataclass(args):
        values = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(args)}
    else:
        values = dict(vars(args))
    found = []
    for name, value in values.items():
        items = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, float) and not math.isfinite(v) for v in items):
            found.append(f"{name}={value}")
    return found


def check_training_values(args) -> None:
    """Refuse values of a `GRPOConfig` (or `OPEFOConfig`) that TRL accepts but that fail once training starts.

    Example:
        >>> from types import SimpleNamespace
        >>> check_training_values(SimpleNamespace(learning_rate=-1.0, max_completion_length=8, temperature=1.0))
        Traceback (most recent call last):
        ...
        ValueError: learning_rate=-1.0: the learning rate must be >= 0 (e.g. 1e-6).
        >>> check_training_values(SimpleNamespace(learning_rate=float("nan"), max_completion_length=8, temperature=1.0))
        Traceback (most recent call last):
        ...
        ValueError: learning_rate=nan: must be a finite number (every number option is, not inf or nan).
    """
    check_report_to(getattr(args, "report_to", []))
    problems = [
        f"{option}: must be a finite number (every number option is, not inf or nan)"
        for option in non_finite_options(args)
    ]
    for option in ("per_device_train_batch_size", "gradient_accumulation_steps"):
        value = getattr(args, option, 1)
        if value < 1:
            problems.append(f"{option}={value}: must be at least 1")
    if args.learning_rate < 0:
        problems.append(f"learning_rate={args.learning_rate}: the learning rate must be >= 0 (e.g. 1e-6)")
    if args.max_completion_length is not None and args.max_completion_length < 1:
        problems.append(
            f"max_completion_length={args.max_completion_length}: completions need at least 1 token (e.g. 512)"
        )
    if getattr(args, "loss_type", None) == "dr_grpo" and args.max_completion_length is None:
        problems.append(
            "loss_type='dr_grpo' with max_completion_length=None: Dr. GRPO divides each loss by the maximum completion "
            "length, so set max_completion_length (e.g. 512) or choose another loss_type"
        )
    if args.temperature <= 0:
        problems.append(
            f"temperature={args.temperature}: GRPO samples completions and scores their log-probabilities at this "
            "temperature, which must be > 0 (1.0 samples the policy as it is)"
        )
    problems += _sampling_and_run_problems(args)
    problems += vllm_option_problems(
        getattr(args, "vllm_gpu_memory_utilization", None), getattr(args, "vllm_tensor_parallel_size", None)
    )
    if problems:
        raise ValueError("; ".join(problems) + ".")


def _sampling_and_run_problems(args) -> list[str]:
    """Values TRL and transformers take that train nothing, something else than asked, or fail later."""
    problems = []
    if getattr(args, "max_steps", -1) == 0:
        problems.append(
            "max_steps=0 asks for no step, and transformers would still train one and save it as the final model; "
            "give max_steps > 0, or -1 (the default) to train num_train_epochs"
        )
    top_p = getattr(args, "top_p", 1.0)
    if not 0 < top_p <= 1:
        problems.append(
            f"top_p={top_p}: nucleus sampling keeps the most likely tokens whose probabilities add up to top_p, which "
            "must be in (0, 1] (1.0 samples the policy as it is; near 0 every completion of a group is the same and "
            "nothing trains)"
        )
    beta = getattr(args, "beta", 0.0)
    if beta < 0:
        problems.append(
            f"beta={beta}: the KL coefficient must be >= 0 (0: no KL term, TRL's default); a negative one rewards "
            "moving away from the reference model"
        )
    for option in ("seed", "data_seed"):
        value = getattr(args, option, None)
        if value is not None and not 0 <= value < 2**32:
            problems.append(f"{option}={value}: seeds must be in [0, 2**32 - 1] (numpy's range)")
    return problems


def mid_rollout_saves(args, steps_per_epoch: int | None = None, save_steps: float | None = None) -> list[int]:
    """The steps, before the run's last, at which ``save_strategy="steps"`` saves a checkpoint between the updates of
    one rollout (:func:`~opefo_trl.runs.at_rollout_boundary`). The run's steps are ``max_steps``, else
    ``num_train_epochs`` epochs of ``steps_per_epoch`` (None: not known, none are listed). The final checkpoint, of
    a finished run, is left to the resume's own check; an epoch ends on a rollout boundary, so
    ``save_strategy="epoch"`` saves none. ``save_steps``: instead of ``args.save_steps``.

    >>> from types import SimpleNamespace
    >>> args = SimpleNamespace(save_strategy="steps", save_steps=500, max_steps=16, steps_per_generation=4,
    ...                        num_iterations=2, gradient_accumulation_steps=3)
    >>> mid_rollout_saves(args, 100), mid_rollout_saves(args, 100, save_steps=4)
    ([], [4, 12])
    """
    strategy = getattr(args, "save_strategy", None)
    if getattr(strategy, "value", strategy) != "steps":
        return []
    counts = ("steps_per_generation", "num_iterations", "gradient_accumulation_steps")
    if not all(isinstance(getattr(args, n, None), int) and getattr(args, n) >= 1 for n in counts):
        return []  # a count below 1 is refused on its own
    if not steps_per_epoch:
        return []
    planned = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * steps_per_epoch)
    save_steps = args.save_steps if save_steps is None else save_steps
    every = math.ceil(planned * save_steps) if save_steps < 1 else int(save_steps)  # as transformers counts them
    saves = range(every, planned, every) if every >= 1 else range(0)
    return [step for step in saves if not at_rollout_boundary(step, args, steps_per_epoch)]


def check_save_steps(args, steps_per_epoch: int | None) -> None:
    """Refuse a ``save_steps`` that saves checkpoints the token method cannot resume from (``steps_per_epoch``: the
    optimizer steps of an epoch over the training data, :func:`dataset_steps_per_epoch`).

    A checkpoint saved between the updates of one rollout (:func:`mid_rollout_saves`) does not hold the rollout, which
    TRL keeps in memory: a resume from it samples a new one. GRPOTrainer resumes so, and ``method="grpo"`` (or a plain
    `GRPOConfig`) does too, after a warning, given here once, with what such a resume loses. A method whose token
    weights come from the rollout refuses such a resume (:func:`~opefo_trl.runs.check_rollout_boundary`), so its
    save_steps is refused instead: ``save_total_limit`` could rotate out every checkpoint it can resume, and the fix
    costs nothing.
    """
    mid_rollout = mid_rollout_saves(args, steps_per_epoch)
    if not mid_rollout:
        return
    from opefo_trl.methods import TOKEN_METHODS

    method = getattr(args, "method", "grpo")
    refused = method in TOKEN_METHODS and TOKEN_METHODS[method].weighs_tokens()
    period = rollout_boundary_period(args)
    suggested = period * max(1, math.ceil(args.save_steps / period))
    shown = ", ".join(map(str, mid_rollout[:3])) + (f" and {len(mid_rollout) - 3} more" if len(mid_rollout) > 3 else "")
    at = f"step{'s' if len(mid_rollout) > 1 else ''} {shown}"
    saves = f"save_steps={args.save_steps} saves checkpoints between the updates of one rollout (at {at})"
    fix = f"a save_steps that is a multiple of {period} (e.g. {suggested})"
    if mid_rollout_saves(args, steps_per_epoch, save_steps=suggested):
        fix = "save_strategy='epoch' (every epoch ends on a rollout boundary)"
    if not refused:
        warnings.warn(
            f"{saves}: {rollout_schedule(args)}. TRL keeps the rollout in memory, not in the checkpoint, so a resume "
            "from one of them samples a new rollout and trains the rest of that rollout's updates on other "
            f"completions than this run does (as GRPOTrainer's resume does). With {fix} every checkpoint is at a "
            "rollout boundary.",
            stacklevel=1,  # here, whoever checks: the same text from the same line is shown once
        )
        return
    raise ValueError(
        f"{saves}: {rollout_schedule(args)}. TRL keeps the rollout in memory, not in the checkpoint, and "
        f"method={method!r} cannot resume from such a checkpoint (its token weights come from the rollout); give "
        f"{fix}."
    )


def vllm_option_problems(gpu_memory_utilization: float | None, tensor_parallel_size: int | None) -> list[str]:
    """What is wrong with vLLM's memory fraction and tensor-parallel size (opefo-train's and opefo-eval's check).

    >>> vllm_option_problems(1.5, 0)  # doctest: +NORMALIZE_WHITESPACE
    ["vllm_gpu_memory_utilization must be in (0, 1] (a fraction of the GPU's memory), got 1.5",
     'vllm_tensor_parallel_size must be at least 1, got 0']
    """
    problems = []
    if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
        problems.append(
            "vllm_gpu_memory_utilization must be in (0, 1] (a fraction of the GPU's memory), got "
            f"{gpu_memory_utilization}"
        )
    if tensor_parallel_size is not None and tensor_parallel_size < 1:
        problems.append(f"vllm_tensor_parallel_size must be at least 1, got {tensor_parallel_size}")
    return problems


def check_report_to(report_to: Any) -> None:
    """Refuse a ``report_to`` the trainer could not log to, before any model loads: transformers refuses an unknown
    name, and a tracker whose package is missing, only once the trainer is built.

    ``report_to`` is as `TrainingArguments` leaves it ("all" and "none" already expanded into a list). Known names are
    transformers' (``INTEGRATION_TO_CALLBACK``); a tracker it does not list as installed
    (``get_available_reporting_integrations``) is built as the trainer would build it, so that its own error, naming
    what to install, is the one reported.

    Example:
        >>> check_report_to(["wandbb"])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: report_to names 'wandbb' (did you mean 'wandb'?), which transformers does not log to; ...
    """
    import difflib

    from transformers.integrations import INTEGRATION_TO_CALLBACK, integration_utils

    names = list(report_to) if isinstance(report_to, (list, tuple)) else [report_to]
    known = ", ".join(["none", "all", *INTEGRATION_TO_CALLBACK])
    not_names = [name for name in names if not isinstance(name, str)]
    if not_names:
        raise ValueError(
            f"report_to={report_to!r} holds {', '.join(map(repr, not_names))}, which is not a tracker's name (YAML "
            "reads an unquoted no, off or false as false, and null as None); write `report_to: none` to log to no "
            f"tracker, or name trackers: {known}."
        )
    names = [name for name in names if name not in ("none", "all")]  # as given, before TrainingArguments expands them
    unknown = []
    for name in names:
        if name not in INTEGRATION_TO_CALLBACK:
            close = difflib.get_close_matches(name, ["none", "all", *INTEGRATION_TO_CALLBACK], n=1)
            unknown.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    if unknown:
        raise ValueError(
            f"report_to names {', '.join(unknown)}, which transformers does not log to; give none, all or trackers "
            f"among: {known}."
        )
    installed = integration_utils.get_available_reporting_integrations()
    missing = []
    for name in names:
        if name in installed:
            continue
        try:  # transformers' own check, with what to install (a tracker it does not list, e.g. flyte, may still build)
            INTEGRATION_TO_CALLBACK[name]()
        except Exception as err:  # noqa: BLE001 - whatever the tracker raises, the trainer would raise it later
            missing.append(f"{name!r} ({str(err).strip()})")
    if missing:
        raise ImportError(
            f"report_to names {', '.join(missing)}, which cannot log here: install what it names, or turn the "
            "tracker off with `--report_to none` (metrics.jsonl in output_dir is written either way)."
        )


def check_vllm_setup(args, model: Any) -> None:
    """Refuse vLLM options that cannot work on this machine, before anything loads (``model``: a path, a hub id or a
    loaded model, for its config).

    Sleep mode and server mode's weight transfer (TRL's ``VLLMClient.init_communicator``, NCCL) need a CUDA GPU;
    vLLM's CPU backend (its CPU build, the only one that runs without a GPU) accepts only some attention head sizes.
    """
    if not getattr(args, "use_vllm", False):
        return
    import importlib.util

    import torch

    on_cuda = torch.cuda.is_available() and not args.use_cpu
    problems = []
    if args.vllm_mode == "colocate" and args.vllm_enable_sleep_mode and not on_cuda:
        problems.append(
            "vllm_enable_sleep_mode=True needs a CUDA GPU (vLLM's CPU platform has no sleep mode: 'Sleep mode is not "
            "supported on current platform'); set vllm_enable_sleep_mode=False (--vllm_enable_sleep_mode false)"
        )
    if args.vllm_mode == "server" and not on_cuda:
        problems.append(
            "vllm_mode='server' sends the weights to the server over NCCL, which needs a CUDA GPU on the trainer's "
            f"side ({'use_cpu=True' if args.use_cpu else 'no CUDA GPU found'}); use vllm_mode='colocate', or train on "
            "a GPU"
        )
    if importlib.util.find_spec("vllm") is None:  # TRL finds out after the model has loaded
        problems.append(
            "use_vllm=True but vLLM is not installed: `pip install 'opefo-trl[vllm]'` (on a machine with a CUDA GPU), "
            "or set use_vllm=False (--use_vllm false) to generate with transformers"
        )
    elif args.vllm_mode == "colocate":
        problems += _vllm_head_size_problems(model)
    if problems:
        raise ValueError("; ".join(problems) + ".")


def active_dropout(model: Any, *, modules: bool = True, trust_remote_code: bool = False) -> list[str]:
    """``name=p`` of the dropout ``model`` (a path, a hub id, a config or a loaded model) trains with: its config's
    dropout probabilities above 0 (which TRL's ``disable_dropout`` leaves as they are) and, for a loaded model with
    ``modules``, its ``torch.nn.Dropout`` modules with p > 0 (which ``disable_dropout`` zeroes).

    >>> from transformers import Qwen2Config
    >>> active_dropout(Qwen2Config(attention_dropout=0.1)), active_dropout(Qwen2Config())
    (['attention_dropout=0.1'], [])
    """
    import torch
    from transformers import PretrainedConfig

    loaded: list[tuple[str, torch.nn.Module]] = []
    config: Any
    if isinstance(model, PretrainedConfig):
        config = model
    elif isinstance(model, str):
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
        except (OSError, ValueError):
            return []  # not readable here: loading reports it
    else:
        config, loaded = getattr(model, "config", None), list(model.named_modules())
    found = []
    if config is not None:
        for name, value in sorted(config.get_text_config().to_dict().items()):
            if ("dropout" in name or "pdrop" in name) and isinstance(value, float) and value > 0:
                found.append(f"{name}={value}")
    dropouts = [(n, m.p) for n, m in loaded if isinstance(m, torch.nn.Dropout) and m.p > 0] if modules else []
    if dropouts:
        found.append(f"{len(dropouts)} torch.nn.Dropout module(s) (first: {dropouts[0][0]}, p={dropouts[0][1]})")
    return found


def check_dropout(args, model: Any, peft_config: Any = None) -> None:
    """Dropout in TRL's training pass, which drops units that the rollout's scoring passes keep: refused by a method
    that weighs tokens, the diagnostics switched off (with a warning) otherwise
    (:func:`~opefo_trl.trainer.config.refuse_or_switch_off_diagnostics`). Checked when the trainer is built, before
    the model loads: the config's dropout probabilities, and with ``disable_dropout=False`` also the model's
    ``torch.nn.Dropout`` modules (a loaded model) and LoRA's ``lora_dropout`` (``peft_config``)."""
    from opefo_trl.methods import get_token_method_class
    from opefo_trl.trainer.config import refuse_or_switch_off_diagnostics

    method_class = get_token_method_class(args.method)
    if not (method_class.weighs_tokens() or args.entropy_flow_diagnostics):
        return
    disabled = getattr(args, "disable_dropout", False)
    found = active_dropout(model, modules=not disabled, trust_remote_code=getattr(args, "trust_remote_code", False))
    lora_dropout = getattr(peft_config, "lora_dropout", 0.0) or 0.0
    if not disabled and lora_dropout > 0:
        found.append(f"lora_dropout={lora_dropout}")
    if found:
        refuse_or_switch_off_diagnostics(
            args,
            method_class,
            f"dropout in training ({', '.join(found)}; disable_dropout={disabled})",
            "TRL's training pass then drops units that the rollout's scoring passes keep, so its gradient is taken "
            "at other log-probabilities",
            "Set disable_dropout=True (it zeroes torch.nn.Dropout, LoRA's dropout included) and any dropout "
            "probability of the model's config to 0",
        )


def _vllm_head_size_problems(model: Any) -> list[str]:
    """The model's attention head size, if vLLM runs on its CPU platform here and its attention refuses that size."""

    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return []
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    if isinstance(model, str):
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(model)
        except OSError:
            return []  # not readable here: loading reports it
    else:
        config = model.config
    config = config.get_text_config()
    head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_size in supported:
        return []
    return [
        f"the model's attention head size is {head_size}, which vLLM's CPU attention does not support (it supports "
        f"{supported}); use a model with one of those head sizes, or use_vllm=False"
    ]


def steps_per_epoch(num_prompts: int, args) -> int:
    """Optimizer steps in one epoch over ``num_prompts`` prompts, as TRL's sampler and transformers' Trainer count
    them (0: the data fills no generation batch, which TRL's ``RepeatSampler`` drops whole).

    Each generation batch takes ``generation_batch_size / num_generations`` distinct prompts (an incomplete last one is
    dropped), is used ``num_iterations`` times and split into ``steps_per_generation`` micro-batches; an optimizer step
    takes ``gradient_accumulation_steps`` of them, the last of an epoch fewer.

    >>> from types import SimpleNamespace
    >>> args = SimpleNamespace(generation_batch_size=8, num_generations=2, num_iterations=1, steps_per_generation=2,
    ...                        gradient_accumulation_steps=2)
    >>> steps_per_epoch(16, args), steps_per_epoch(3, args)
    (4, 0)
    """
    generations = num_prompts // (args.generation_batch_size // args.num_generations)
    micro_batches = generations * args.num_iterations * args.steps_per_generation
    return math.ceil(micro_batches / args.gradient_accumulation_steps)


def dataset_steps_per_epoch(dataset: Any, args) -> int | None:
    """:func:`steps_per_epoch` over ``dataset``; for one without a length (an iterable data set), ``max_steps`` (one
    epoch of them, as transformers' Trainer counts it), None if not set."""
    try:
        return steps_per_epoch(len(dataset), args)
    except TypeError:
        return args.max_steps if args.max_steps > 0 else None


def planned_steps(num_prompts: int, args) -> int:
    """The optimizer steps a run trains from step 0: ``max_steps`` when set (> 0), else ``num_train_epochs`` epochs,
    as transformers' Trainer rounds them (up); 0 when one epoch has none."""
    per_epoch = steps_per_epoch(num_prompts, args)
    if per_epoch == 0:
        return 0
    return args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * per_epoch)


def check_trains_some_steps(num_prompts: int, args) -> int:
    """Refuse a run that would train no step, naming why; returns its planned steps (:func:`planned_steps`)."""
    prompts_per_generation = args.generation_batch_size // args.num_generations
    if steps_per_epoch(num_prompts, args) == 0:
        raise ValueError(
            f"The training data has {num_prompts} problem(s), fewer than one generation batch takes "
            f"({prompts_per_generation}: generation_batch_size {args.generation_batch_size} / num_generations "
            f"{args.num_generations}); TRL drops an incomplete generation batch, so this run would train 0 steps. "
            "Give more data, or a smaller per_device_train_batch_size / steps_per_generation."
        )
    steps = planned_steps(num_prompts, args)
    if steps <= 0:
        raise ValueError(
            f"num_train_epochs={args.num_train_epochs} with max_steps={args.max_steps} trains 0 steps; give "
            "num_train_epochs > 0 or max_steps > 0."
        )
    return steps


class RewardFunctionError(ValueError):
    """A reward function raised or returned something that is not one finite number (or None) per completion."""


def _is_reward(value: Any) -> bool:
    if value is None or (isinstance(value, numbers.Real) and not isinstance(value, (str, bytes))):
        return True
    # a 0-d numpy array / torch tensor holding a real number
    return getattr(value, "ndim", None) == 0 and isinstance(value.item(), numbers.Real)


def _as_list(rewards: Any) -> list | None:
    """The rewards as a list (an array or tensor through ``tolist``, any other iterable but text or a mapping)."""
    if isinstance(rewards, (str, bytes, Mapping)) or not isinstance(rewards, Iterable):
        return None
    return rewards.tolist() if hasattr(rewards, "tolist") else list(rewards)


def reward_problem(name: str, rewards: Any, expected: int | None) -> str | None:
    """What is wrong with what reward function ``name`` returned for ``expected`` completions (None: a call that
    did not show how many, any number of rewards); None if nothing."""
    values = _as_list(rewards)
    if not isinstance(values, list):  # (a 0-d array's tolist() is a number)
        count = "" if expected is None else f"{expected} "
        return (
            f"Reward function {name!r} returned {rewards!r:.200} (a {type(rewards).__name__}); it must return a list "
            f"of {count}numbers, one per completion (None leaves a completion out)."
        )
    if expected is None:
        expected = len(values)
    if len(values) != expected:
        return (
            f"Reward function {name!r} returned {len(values)} rewards for {expected} completions; it must return one "
            "per completion (None leaves a completion out)."
        )
    bad = [(i, v) for i, v in enumerate(values) if not _is_reward(v)]
    if bad:
        index, value = bad[0]
        return (
            f"Reward function {name!r} returned {value!r:.200} (a {type(value).__name__}) for completion {index} of "
            f"{expected} ({len(bad)} such value(s) in this batch); rewards must be numbers (int or float), or None "
            "to leave a completion out. Convert them in the function, e.g. `float(score)`."
        )
    non_finite = [i for i, v in enumerate(values) if v is not None and not _fits_float(v)]
    if non_finite:
        return (
            f"Reward function {name!r} returned {_shown(values[non_finite[0]])} for {len(non_finite)} of {expected} "
            f"completions (first: completion {non_finite[0]}); a non-finite reward (inf or NaN) makes its group's "
            "advantages NaN, then 0, and trains nothing. Return a finite number, or None to leave a completion out."
        )
    limit = largest_reward(expected)
    too_large = [i for i, v in enumerate(values) if v is not None and abs(float(v)) > limit]
    if too_large:
        return (
            f"Reward function {name!r} returned {_shown(values[too_large[0]])} for {len(too_large)} of {expected} "
            f"completions (first: completion {too_large[0]}); TRL holds rewards in float32 and sums them for each "
            f"group's mean and standard deviation, which overflow to inf above |reward| = {limit:.3g} (then every "
            "advantage is 0 and nothing trains). Scale the rewards down, e.g. into [0, 1]."
        )
    return None


def largest_reward(num_completions: int) -> float:
    """The largest |reward| whose sums over ``num_completions`` completions, and deviations from their mean (up to
    twice it), stay below float32's largest number: TRL's group means and standard deviations are then finite."""
    import torch

    return torch.finfo(torch.float32).max / (2 * max(num_completions, 1))


def _fits_float(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an int beyond float's range (10**400)
        return False


def _shown(value: Any) -> str:
    try:
        return repr(float(value))
    except OverflowError:
        return f"an integer of {len(str(abs(int(value))))} digits"


#: What TRL passes a reward function with one entry per completion. A direct call may pass only some of them (TRL's
#: reward of an environment that owns it takes only ``environments``): the first one given says how many rewards.
PER_COMPLETION_KWARGS = ("completions", "prompts", "completion_ids", "environments")

#: What TRL gives every reward function as it is: the trainer's state and its logging hooks, not data.
SHARED_REWARD_KWARGS = frozenset({"trainer_state", "log_extra", "log_metric", "environments"})


def own_copy(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A reward function's own copy of its inputs (prompts, completions, the data columns): TRL hands every function
    the same lists, so one that changes them would change what the next one is given."""
    return {key: value if key in SHARED_REWARD_KWARGS else copy.deepcopy(value) for key, value in kwargs.items()}


def _num_completions(kwargs: dict[str, Any]) -> int | None:
    """How many rewards a reward function's call must return, where its arguments show it."""
    return next((len(kwargs[key]) for key in PER_COMPLETION_KWARGS if key in kwargs), None)


def _where(err: BaseException) -> str:
    frames = traceback.extract_tb(err.__traceback__)
    return f" at {frames[-1].filename}:{frames[-1].lineno} ({frames[-1].name})" if frames else ""


class RewardCheck:
    """Checks the reward functions of each reward computation: :meth:`wrap` them once, then for every computation
    :meth:`start` it, compute, and :meth:`raise_if_failed`.

    A failing function is replaced by zeros for the rest of the computation, so that every process reaches the
    gather of the rewards; the first failure is kept and raised afterwards. A checked function keeps the user's
    function's name and holds it as ``__wrapped__`` (``inspect.signature`` gives the function's), and takes the same
    arguments.

    Example:
        >>> check = RewardCheck()
        >>> [wrapped] = check.wrap([lambda completions, **kwargs: ["1", "0"]], ["string_reward"])
        >>> wrapped(completions=["a", "b"])
        [0.0, 0.0]
        >>> check.raise_if_failed()  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        opefo_trl.trainer.checks.RewardFunctionError: Reward function 'string_reward' returned '1' (a str) ...
    """

    def __init__(self) -> None:
        self.error: RewardFunctionError | None = None

    def start(self) -> None:
        """A new reward computation: every function is called again."""
        self.error = None

    def _result(self, name: str, rewards: Any, raised: BaseException | None, num_completions: int | None) -> Any:
        """The rewards if they are fine; else zeros, keeping the first failure. A call that did not show how many
        completions it scores (not TRL's, which passes ``completions``) has no zeros to give: its failure is raised."""
        failure: RewardFunctionError | None
        if raised is not None:
            failure = RewardFunctionError(
                f"Reward function {name!r} raised {type(raised).__name__}: {raised}{_where(raised)}. Fix the "
                "function: it must return one number, or None, per completion."
            )
            failure.__cause__ = raised
        else:
            listed = rewards if isinstance(rewards, Sequence) else _as_list(rewards)  # a generator is read once
            problem = reward_problem(name, rewards if listed is None else listed, num_completions)
            rewards = listed
            failure = None if problem is None else RewardFunctionError(problem)
        if failure is None:
            return rewards
        if num_completions is None:
            raise failure
        self.error = self.error or failure
        return [0.0] * num_completions

    def wrap_one(self, func: Callable, name: str, is_async: bool) -> Callable:
        """``func`` checked, given what it is given (it takes the same arguments); after a failure, no further
        reward function of this computation is called."""
        if is_async:

            @functools.wraps(func)
            async def checked_async(*args, **kwargs):
                num_completions = _num_completions(kwargs)
                if self.error is not None and num_completions is not None:
                    return [0.0] * num_completions
                try:
                    rewards = await func(*args, **own_copy(kwargs))
                except (Exception, SystemExit) as err:  # user code: reported with where it was raised
                    return self._result(name, None, err, num_completions)
                return self._result(name, rewards, None, num_completions)

            return checked_async

        @functools.wraps(func)
        def checked(*args, **kwargs):
            num_completions = _num_completions(kwargs)
            if self.error is not None and num_completions is not None:
                return [0.0] * num_completions
            try:
                rewards = func(*args, **own_copy(kwargs))
            except (Exception, SystemExit) as err:  # user code, sys.exit() included: named, not a bare exit
                return self._result(name, None, err, num_completions)
            return self._result(name, rewards, None, num_completions)

        return checked

    def wrap(self, funcs: Sequence[Any], names: Sequence[str]) -> list:
        """The functions, each checked; reward models (`torch.nn.Module`) are returned as they are."""
        import torch

        return [
            func if isinstance(func, torch.nn.Module) else self.wrap_one(func, name, is_async_callable(func))
            for func, name in zip(funcs, names, strict=True)
        ]

    def raise_if_failed(self, failures_on_all_processes: int | None = None) -> None:
        """Raise the failure seen here, or, when only other processes failed, say so."""
        if self.error is not None:
            raise self.error
        if failures_on_all_processes:
            raise RewardFunctionError(
                f"A reward function failed on {failures_on_all_processes} other process(es); their error message "
                "names it."
            )
