"""opefo_trl.data.train_dataset: opefo-train's training data built before any weights load (the context its prompts
must fit, the fixed probe set aside). End to end through `opefo-train`: tests/cli/test_train.py."""

import json
from types import SimpleNamespace

import pytest
from datasets import Dataset

from opefo_trl.data.loading import prompt_token_lengths
from opefo_trl.data.train_dataset import context_length_for, load_tokenizer, load_train_dataset, split_probe


def _options(model_path, problems_file, **script):
    script_args = SimpleNamespace(
        dataset_name="local",
        prompt_template="plain",
        dataset_train_split="train",
        dataset_config=None,
        dataset_files=[problems_file],
        problem_column="prompt",
        answer_column="solution",
        answer_format="plain",
        deduplicate=None,
        max_train_samples=None,
        context_length=None,
        drop_overlong_prompts=False,
    )
    script_args.__dict__.update(script)
    training_args = SimpleNamespace(
        use_vllm=False, vllm_max_model_length=None, trust_remote_code=False, max_completion_length=8,
        chat_template_kwargs=None,
    )  # fmt: skip
    model_args = SimpleNamespace(model_name_or_path=str(model_path), model_revision=None)
    return script_args, training_args, model_args


def test_the_context_is_the_option_else_the_models_capped_by_vllms(tiny_model_path, problems_file):
    script_args, training_args, model_args = _options(tiny_model_path, problems_file)
    with open(f"{tiny_model_path}/config.json") as f:
        model_context = json.load(f)["max_position_embeddings"]
    assert context_length_for(script_args, training_args, model_args) == model_context
    script_args.context_length = 64
    assert context_length_for(script_args, training_args, model_args) == 64
    training_args.use_vllm, training_args.vllm_max_model_length = True, 32
    assert context_length_for(script_args, training_args, model_args) == 32


def test_prompts_longer_than_the_context_are_refused_or_dropped(tiny_model_path, problems_file):
    script_args, training_args, model_args = _options(tiny_model_path, problems_file)
    tokenizer = load_tokenizer(model_args, training_args)
    dataset, context = load_train_dataset(script_args, training_args, model_args, tokenizer)
    assert len(dataset) == 16 and {"prompt", "solution"} <= set(dataset.column_names)
    lengths = prompt_token_lengths(dataset, tokenizer)
    assert max(lengths) + training_args.max_completion_length <= context
    script_args.context_length = min(lengths) + training_args.max_completion_length - 1
    with pytest.raises(ValueError, match=r"16 of 16 prompts are longer than .*set drop_overlong_prompts"):
        load_train_dataset(script_args, training_args, model_args, tokenizer)
    script_args.drop_overlong_prompts = True
    with pytest.raises(ValueError, match="dropping them would leave no data"):
        load_train_dataset(script_args, training_args, model_args, tokenizer)
    script_args.context_length = max(lengths) + training_args.max_completion_length - 1  # the longest dropped
    kept, _ = load_train_dataset(script_args, training_args, model_args, tokenizer)
    assert len(kept) == sum(n < max(lengths) for n in lengths) > 0


def test_a_tokenizer_that_cannot_be_loaded_is_named():
    model_args = SimpleNamespace(model_name_or_path="nobody/no-such-model", model_revision=None)  # offline, not cached
    with pytest.raises(FileNotFoundError, match="Cannot load the tokenizer of 'nobody/no-such-model': "):
        load_tokenizer(model_args, SimpleNamespace(trust_remote_code=False))


def test_the_probe_is_the_last_rows_and_never_every_row():
    dataset = Dataset.from_dict({"problem": [str(i) for i in range(5)]})
    assert split_probe(dataset, 0) == (dataset, None)
    train, probe = split_probe(dataset, 2)
    assert train["problem"] == ["0", "1", "2"] and probe["problem"] == ["3", "4"]
    with pytest.raises(ValueError) as raised:
        split_probe(dataset, 5)
    assert str(raised.value) == (
        "probe_prompts=5 would set aside every one of the 5 problems; give fewer, or more data."
    )
