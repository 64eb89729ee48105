"""The training data of ``opefo-train``, built before any model weights load: the data set loaded and its prompts
rendered (:mod:`opefo_trl.data.loading`), every prompt checked to fit the model's context with
``max_completion_length``, and the last rows set aside as the fixed probe.

The functions read the run's parsed options: ``script_args`` (``opefo_trl.cli.train.TrainScriptArguments``),
``training_args`` (``OPEFOConfig``) and ``model_args`` (``trl.ModelConfig``).

Example:
    >>> tokenizer = load_tokenizer(model_args, training_args)  # doctest: +SKIP
    >>> dataset, context = load_train_dataset(script_args, training_args, model_args, tokenizer)  # doctest: +SKIP
    >>> train_dataset, probe_dataset = split_probe(dataset, script_args.probe_prompts)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

from opefo_trl.data.loading import check_prompt_lengths, load_math_dataset
from opefo_trl.data.model_files import model_context_length


def load_tokenizer(model_args: Any, training_args: Any):
    """The tokenizer of the model the run trains; a model without one is a FileNotFoundError naming it."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(
            model_args.model_name_or_path,
            revision=model_args.model_revision,
            trust_remote_code=training_args.trust_remote_code,
        )
    except OSError as err:  # not on the hub, not in the cache when offline, or a directory without a tokenizer
        raise FileNotFoundError(f"Cannot load the tokenizer of {model_args.model_name_or_path!r}: {err}") from err


def context_length_for(script_args: Any, training_args: Any, model_args: Any) -> int:
    """The context prompts must fit: `context_length`, else the model's max_position_embeddings; capped by vLLM's."""
    context = model_context_length(
        model_args.model_name_or_path,
        context_length=script_args.context_length,
        max_model_len=training_args.vllm_max_model_length if training_args.use_vllm else None,
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
    )
    if context is None:
        raise ValueError(
            f"The config of {model_args.model_name_or_path!r} has no max_position_embeddings; set context_length "
            "to the model's context in tokens."
        )
    return context


def load_train_dataset(script_args: Any, training_args: Any, model_args: Any, tokenizer: Any) -> tuple[Any, int]:
    """The data set with its prompts rendered, every prompt checked (or dropped, with ``drop_overlong_prompts``) to
    fit the context with ``max_completion_length``; and that context (:func:`context_length_for`)."""
    dataset = load_math_dataset(
        script_args.dataset_name,
        template=script_args.prompt_template,
        split=script_args.dataset_train_split,
        config=script_args.dataset_config,
        data_files=script_args.dataset_files,
        problem_column=script_args.problem_column,
        answer_column=script_args.answer_column,
        answer_format=script_args.answer_format,
        deduplicate=script_args.deduplicate,
        max_samples=script_args.max_train_samples,
    )
    context = context_length_for(script_args, training_args, model_args)
    dataset = check_prompt_lengths(
        dataset,
        tokenizer,
        max_completion_length=training_args.max_completion_length,
        max_position_embeddings=context,
        drop_overlong=script_args.drop_overlong_prompts,
        chat_template_kwargs=training_args.chat_template_kwargs,
    )
    return dataset, context


def split_probe(dataset: Any, probe_prompts: int) -> tuple:
    """The training data without its last ``probe_prompts`` rows, and those rows (None when 0): the fixed probe.

    Raises:
        ValueError: ``probe_prompts`` would leave no problem to train on.
    """
    if not probe_prompts:
        return dataset, None
    if probe_prompts >= len(dataset):
        raise ValueError(
            f"probe_prompts={probe_prompts} would set aside every one of the {len(dataset)} problems; give fewer, or "
            "more data."
        )
    kept = len(dataset) - probe_prompts
    return dataset.select(range(kept)), dataset.select(range(kept, len(dataset)))
