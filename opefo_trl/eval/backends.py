"""Where the model comes from and how samples are drawn: the transformers and vLLM backends.

Both backends draw every sample with its own seed (:attr:`SampleJob.seed <opefo_trl.eval.store.SampleJob>`):

- ``transformers``: batched ``model.generate`` (left padding, several prompts x samples per call); temperature and
  top-p come from transformers' warpers, then one random generator per row adds Gumbel noise and decoding picks the
  largest score (Gumbel-max sampling), so a row's random draws do not depend on the other rows.
- ``vllm``: one request per sample (``n=1``) with that sample's seed; vLLM's prefix caching (on by default) computes a
  prompt shared by several requests once.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from opefo_trl.data.model_files import (
    check_has_tokenizer,
    check_has_weights,
    check_model_config,
    looks_like_local_path,
    model_file_fingerprints,
    non_finite_names,
    non_finite_weights,
    read_json_mapping,
    weight_fingerprints,
)

from .config import BACKENDS, EvaluationConfig
from .store import SampleJob


@dataclass(frozen=True)
class ModelSource:
    """The weights to load: a full model, or a base model plus a LoRA adapter."""

    model_path: str
    adapter_path: str | None = None
    tokenizer_path: str | None = None

    def weight_fingerprints(self) -> dict[str, str]:
        """Content fingerprints of the local weight files, ``model/<file>`` and ``adapter/<file>``
        (:func:`opefo_trl.data.model_files.weight_fingerprints`); a hub model is known by its id alone."""
        prints = {f"model/{name}": value for name, value in weight_fingerprints(self.model_path).items()}
        if self.adapter_path is not None:
            prints.update({f"adapter/{name}": value for name, value in weight_fingerprints(self.adapter_path).items()})
        return prints

    def check_finite_weights(self) -> None:
        """Refuse weights holding NaN or inf (read from the local safetensors files, one tensor at a time, before
        any backend loads them): such a model generates nothing a reader can score, and its samples would be scored
        0.0 as if it had answered wrongly."""
        bad = [
            f"{role}/{name}"
            for role, folder in (("model", self.model_path), ("adapter", self.adapter_path))
            if folder is not None
            for name in non_finite_tensors(folder)
        ]
        if bad:
            raise ValueError(
                f"{non_finite_weights(self.adapter_path or self.model_path, bad)}: the model cannot generate anything "
                "to score (its samples would count as wrong answers). Evaluate an earlier checkpoint of the run, whose "
                "weights are finite."
            )

    def file_fingerprints(self) -> dict[str, str]:
        """Content fingerprints of the files besides the weights that decide what is generated
        (:func:`opefo_trl.data.model_files.model_file_fingerprints`): ``model/``, ``adapter/`` and ``tokenizer/<file>``
        (the tokenizer's folder when it is another one)."""
        prints = {}
        folders = {"model": self.model_path, "adapter": self.adapter_path, "tokenizer": self.tokenizer_path}
        seen: set[str] = set()
        for role, folder in folders.items():
            if folder is None or os.path.realpath(folder) in seen:
                continue
            seen.add(os.path.realpath(folder))
            prints.update({f"{role}/{name}": value for name, value in model_file_fingerprints(folder).items()})
        return prints


def non_finite_tensors(directory: str) -> list[str]:
    """``file:tensor`` of every floating-point tensor of the ``*.safetensors`` files of ``directory`` that holds NaN
    or inf (:func:`~opefo_trl.data.model_files.non_finite_names`), read one tensor at a time (other weight formats,
    and a hub id, are not read: nothing is reported)."""
    from safetensors import safe_open

    if not os.path.isdir(directory):
        return []
    found = []
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".safetensors"):
            continue
        with safe_open(os.path.join(directory, name), framework="pt") as f:
            keys = list(f.keys())
            found += [f"{name}:{key}" for key in non_finite_names((key, f.get_tensor(key)) for key in keys)]
    return found


def _no_model_message(path: str) -> str:
    """Why the folder ``path`` holds no model, and what to evaluate: a run folder whose final model is not in place
    (staged, or kept unfinished after a kill) says so."""
    from opefo_trl.runs import FINAL_MODEL_STAGING, checkpoints, unfinished_final_models

    found = f"{path} holds neither a model (config.json) nor a PEFT adapter (adapter_config.json)"
    saved = [checkpoint for _, checkpoint in checkpoints(path)]
    instead = f", or evaluate one of its checkpoints (--model_name_or_path {saved[-1]})" if saved else ""
    staging = os.path.join(path, FINAL_MODEL_STAGING)
    if os.path.isdir(staging):
        return (
            f"{found}: the final model of its run is still staged in {staging} (that run is saving it, or was stopped "
            f"while it did). Once the run has ended, run its opefo-train command again, which moves the model into "
            f"place (or keeps it aside, saying where, if it is not whole), then evaluate {path}{instead}."
        )
    kept = unfinished_final_models(path)
    if kept:
        return (
            f"{found}: its run was killed while saving its final model, which is kept in {kept[-1]} and may lack "
            f"files (opefo-train's command for {path} says which). Evaluate that folder if it is whole enough "
            f"(--model_name_or_path {kept[-1]}){instead}."
        )
    return found + "."


def resolve_model_source(model_name_or_path: str, base_model_name_or_path: str | None = None) -> ModelSource:
    """Find out what ``model_name_or_path`` is without loading weights.

    A directory with ``adapter_config.json`` is a PEFT adapter (base: ``base_model_name_or_path`` or the adapter's
    own ``base_model_name_or_path``); a directory with ``config.json`` is a full model; anything else that is not a
    local-looking path is treated as a hub id.

    Raises:
        FileNotFoundError: a local path that does not exist, or a directory that holds no model or no weights.
        ValueError: an adapter whose base model is unknown; a config.json or adapter_config.json that is not a
            JSON mapping, or a config that does not fit the weights (``check_model_config``).
    """
    path = os.path.expanduser(model_name_or_path)
    if os.path.isdir(path):
        adapter_config = os.path.join(path, "adapter_config.json")
        if os.path.isfile(adapter_config):
            adapter_settings = read_json_mapping(adapter_config, "the adapter's settings")
            base = base_model_name_or_path or adapter_settings.get("base_model_name_or_path")
            if not base:
                raise ValueError(
                    f"{path} is a PEFT adapter whose adapter_config.json names no base model; pass "
                    "base_model_name_or_path."
                )
            base_path = os.path.expanduser(base)
            if looks_like_local_path(base) and not os.path.isdir(base_path):
                raise FileNotFoundError(
                    f"The base model {base!r} of adapter {path} does not exist; pass base_model_name_or_path."
                )
            check_has_weights(path)
            if os.path.isdir(base_path):
                check_has_weights(base_path)
                check_model_config(base_path)
            has_tokenizer = os.path.isfile(os.path.join(path, "tokenizer_config.json"))
            tokenizer_path = path if has_tokenizer else base_path
            if os.path.isdir(tokenizer_path):
                check_has_tokenizer(tokenizer_path)
            return ModelSource(base_path, adapter_path=path, tokenizer_path=tokenizer_path)
        if os.path.isfile(os.path.join(path, "config.json")):
            check_has_weights(path)
            check_has_tokenizer(path)
            check_model_config(path)
            return ModelSource(path, tokenizer_path=path)
        raise FileNotFoundError(_no_model_message(path))
    if os.path.exists(path) or looks_like_local_path(model_name_or_path):
        raise FileNotFoundError(f"Model path {model_name_or_path!r} does not exist.")
    return ModelSource(model_name_or_path, tokenizer_path=model_name_or_path)


def loading_error(what: str, err: OSError) -> FileNotFoundError:
    """transformers' OSError for files it cannot find (not on the hub, not in the cache when offline, not in a
    folder), on one line, naming ``what`` failed to load."""
    return FileNotFoundError(f"Cannot load {what}: {' '.join(str(err).split())}")


def vllm_is_available() -> bool:
    """Whether vLLM can be imported (checked without importing it)."""
    return importlib.util.find_spec("vllm") is not None


def select_backend(requested: str, vllm_available: bool | None = None, cuda_available: bool | None = None) -> str:
    """Resolve ``"auto"`` / ``"vllm"`` / ``"transformers"`` to the backend that will run.

    ``"auto"`` picks vLLM when it is installed and a GPU is visible, else transformers.

    Raises:
        ImportError: ``"vllm"`` was asked for but vLLM is not installed.

    Example:
        >>> auto = "auto"
        >>> select_backend(auto, vllm_available=False), select_backend(auto, vllm_available=True, cuda_available=True)
        ('transformers', 'vllm')
    """
    if requested not in BACKENDS:
        raise ValueError(f"Unknown backend {requested!r}; choose one of {', '.join(BACKENDS)}.")
    if vllm_available is None:
        vllm_available = vllm_is_available()
    if requested == "transformers":
        return "transformers"
    if requested == "vllm":
        if not vllm_available:
            raise ImportError(
                "backend='vllm' but vLLM is not installed: `pip install 'opefo-trl[vllm]'`, or use "
                "backend='transformers'."
            )
        return "vllm"
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    return "vllm" if vllm_available and cuda_available else "transformers"


@dataclass(frozen=True)
class GeneratedSample:
    """What a backend returns for one job: the completion text, its token count and why it ended."""

    completion: str
    num_tokens: int
    finish_reason: str  # "stop" (end of sequence) or "length" (max_new_tokens reached)


def _torch_dtype(name: str, device: str):
    import torch

    if name == "auto":
        if device.startswith("cuda") and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float16 if device.startswith("cuda") else torch.float32
    return getattr(torch, name)


def _make_seeded_gumbel_processor():
    """Build the per-row seeded sampler class lazily (transformers is imported only when generating)."""
    import torch
    from transformers import LogitsProcessor

    class SeededGumbelSampler(LogitsProcessor):
        """Adds independent Gumbel noise per row, from one generator per row; greedy decoding of the result draws
        each row's token from softmax(scores) (Gumbel-max trick), reproducibly whatever the batch holds."""

        def __init__(self, seeds: Sequence[int], device):
            self.generators = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]

        def __call__(self, input_ids, scores):
            vocab = scores.shape[-1]
            tiny = torch.finfo(torch.float32).tiny
            uniform = torch.stack(
                [torch.rand(vocab, generator=g, device=scores.device, dtype=torch.float32) for g in self.generators]
            )
            gumbel = -torch.log(-torch.log(uniform.clamp_(min=tiny)))
            return scores.float() + gumbel

    return SeededGumbelSampler


class TransformersBackend:
    """Batched ``model.generate`` with per-sample seeds; runs on CPU or GPU.

    Several prompts x samples go into one ``generate`` call (left padded); each row samples with its own random
    generator (temperature and top-p via transformers' warpers, then Gumbel-max), so a row's random draws do not
    depend on how jobs were batched. Its logits can: left padding to another width and other batch sizes change the
    rounding of the forward pass, which in bf16 / fp16 can tip a sampled token (see :mod:`opefo_trl.eval`).
    """

    def __init__(self, model, tokenizer, config: EvaluationConfig):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.device = next(model.parameters()).device
        eos = model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
        if tokenizer.eos_token_id is not None:
            eos_ids.add(tokenizer.eos_token_id)
        if not eos_ids:
            raise ValueError(
                "Neither the model's generation_config nor the tokenizer defines an end-of-sequence token."
            )
        self.eos_ids = sorted(eos_ids)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]
        self._sampler_cls = _make_seeded_gumbel_processor()

    @classmethod
    def load(cls, source: ModelSource, config: EvaluationConfig, tokenizer) -> TransformersBackend:
        import torch
        from transformers import AutoModelForCausalLM

        device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        try:
            model = AutoModelForCausalLM.from_pretrained(
                source.model_path,
                dtype=_torch_dtype(config.dtype, device),
                device_map=device if device.startswith("cuda") else None,  # straight to the GPU, no CPU copy
            )
        except OSError as err:  # e.g. an adapter's base model neither on the hub nor in the cache when offline
            raise loading_error(f"the model {source.model_path!r}", err) from err
        if source.adapter_path is not None:
            try:
                from peft import PeftModel
            except ImportError as err:
                raise ImportError("Evaluating a LoRA adapter needs peft: `pip install 'opefo-trl[peft]'`.") from err
            model = PeftModel.from_pretrained(model, source.adapter_path).merge_and_unload()
        model.to(device).eval()  # type: ignore[arg-type]  # transformers' @wraps(Module.to) drops the bound self
        return cls(model, tokenizer, config)

    def generate(self, jobs: Sequence[SampleJob]) -> list[GeneratedSample]:
        """Draw one sample per job, each with its own seed, in a single ``generate`` call."""
        import torch
        from transformers import GenerationConfig, LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

        width = max(len(job.prompt_ids) for job in jobs)
        input_ids = torch.full((len(jobs), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(jobs), width), dtype=torch.long)
        for row, job in enumerate(jobs):
            input_ids[row, width - len(job.prompt_ids) :] = torch.tensor(job.prompt_ids)
            attention_mask[row, width - len(job.prompt_ids) :] = 1
        processors = LogitsProcessorList()
        if self.config.temperature > 0:
            processors.append(TemperatureLogitsWarper(self.config.temperature))
            if self.config.top_p < 1.0:
                processors.append(TopPLogitsWarper(self.config.top_p))
            processors.append(self._sampler_cls([job.seed for job in jobs], self.device))
        generation_config = GenerationConfig(
            max_new_tokens=self.config.max_new_tokens,
            do_sample=False,  # greedy over Gumbel-perturbed scores = sampling (see SeededGumbelSampler)
            num_beams=1,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
            # Neutral values, so that the model's generation_config (e.g. top_k=20, repetition_penalty=1.05) is not
            # merged in: the protocol is temperature + top-p only.
            temperature=1.0,
            top_k=50,
            top_p=1.0,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
        )
        with torch.inference_mode():
            output = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                generation_config=generation_config,
                logits_processor=processors,
            )
        completions = output[:, width:].tolist()
        samples = []
        eos = set(self.eos_ids)
        for ids in completions:
            end = next((i for i, t in enumerate(ids) if t in eos), None)
            kept = ids if end is None else ids[: end + 1]
            text = self.tokenizer.decode(kept, skip_special_tokens=True)
            samples.append(GeneratedSample(text, len(kept), "length" if end is None else "stop"))
        return samples

    def run(self, jobs: Sequence[SampleJob]) -> Iterator[tuple[list[SampleJob], list[GeneratedSample]]]:
        """Yield (jobs, samples) batch by batch."""
        for start in range(0, len(jobs), self.config.batch_size):
            batch = list(jobs[start : start + self.config.batch_size])
            yield batch, self.generate(batch)


class VLLMBackend:
    """vLLM generation: one request per sample with its own seed, ``vllm_problems_per_call`` problems per call
    (vLLM is imported lazily)."""

    def __init__(self, source: ModelSource, config: EvaluationConfig):
        from vllm import LLM

        self.config = config
        kwargs = dict(
            model=source.model_path,
            tokenizer=source.tokenizer_path or source.model_path,
            seed=config.seed,
            dtype=config.dtype,
            gpu_memory_utilization=config.vllm_gpu_memory_utilization,
            tensor_parallel_size=config.vllm_tensor_parallel_size,
            max_model_len=config.max_model_len,
        )
        self.lora_request = None
        if source.adapter_path is not None:
            from vllm.lora.request import LoRARequest

            with open(os.path.join(source.adapter_path, "adapter_config.json")) as f:
                rank = int(json.load(f).get("r", 16))
            # vLLM accepts power-of-two LoRA ranks from 8 up.
            kwargs.update(enable_lora=True, max_lora_rank=2 ** math.ceil(math.log2(max(8, rank))))
            self.lora_request = LoRARequest("adapter", 1, source.adapter_path)
        self.llm = LLM(**kwargs)

    def run(self, jobs: Sequence[SampleJob]) -> Iterator[tuple[list[SampleJob], list[GeneratedSample]]]:
        from vllm import SamplingParams

        groups = _group_by_problem(jobs)
        for start in range(0, len(groups), self.config.vllm_problems_per_call):
            batch_jobs = [job for group in groups[start : start + self.config.vllm_problems_per_call] for job in group]
            requests = build_vllm_requests(batch_jobs, self.config)
            outputs = self.llm.generate(
                [prompt for prompt, _ in requests],
                [SamplingParams(**sampling) for _, sampling in requests],
                lora_request=self.lora_request,
                use_tqdm=False,
            )
            if len(outputs) != len(batch_jobs) or any(len(output.outputs) != 1 for output in outputs):
                raise RuntimeError(
                    f"vLLM answered {len(outputs)} requests with {[len(o.outputs) for o in outputs]} samples; "
                    f"{len(batch_jobs)} requests of one sample each were sent."
                )
            samples = []
            for output in outputs:
                completion = output.outputs[0]
                finish = "length" if completion.finish_reason == "length" else "stop"
                samples.append(GeneratedSample(completion.text, len(completion.token_ids), finish))
            yield batch_jobs, samples


def build_vllm_requests(
    jobs: Sequence[SampleJob], config: EvaluationConfig
) -> list[tuple[dict[str, list[int]], dict[str, Any]]]:
    """One vLLM request per job: ``({"prompt_token_ids": ...}, SamplingParams kwargs)`` with ``n=1`` and the job's
    own seed, so a sample is drawn alike however many samples of its problem were stored before.

    Example:
        >>> jobs = [SampleJob("b", 0, i, "f", (1, 2), seed=100 + i) for i in range(2)]
        >>> requests = build_vllm_requests(jobs, EvaluationConfig(model_name_or_path="m", max_new_tokens=5))
        >>> [(prompt, sampling["n"], sampling["seed"], sampling["max_tokens"]) for prompt, sampling in requests]
        [({'prompt_token_ids': [1, 2]}, 1, 100, 5), ({'prompt_token_ids': [1, 2]}, 1, 101, 5)]
    """
    sampling = {
        "n": 1,
        "temperature": config.temperature,
        "top_p": config.top_p if config.temperature > 0 else 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "max_tokens": config.max_new_tokens,
    }
    return [({"prompt_token_ids": list(job.prompt_ids)}, {**sampling, "seed": job.seed}) for job in jobs]


def _group_by_problem(jobs: Sequence[SampleJob]) -> list[list[SampleJob]]:
    """Adjacent jobs of one problem, grouped (a call never splits a problem's pending samples)."""
    groups: list[list[SampleJob]] = []
    for job in jobs:
        if groups and (groups[-1][0].benchmark, groups[-1][0].problem_id) == (job.benchmark, job.problem_id):
            groups[-1].append(job)
        else:
            groups.append([job])
    return groups
