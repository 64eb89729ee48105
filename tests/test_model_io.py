"""opefo_trl.model_io: local data files, context length, prompt rendering and completion text."""

import pytest

from opefo_trl.model_io import (
    completion_to_text,
    is_local_data_file,
    load_local_files,
    local_file_builder,
    model_context_length,
    render_prompts,
)

# ----------------------------------------------------------------------------------------------------------------------
# Local data files
# ----------------------------------------------------------------------------------------------------------------------


def test_local_files_load_by_extension(tmp_path, write_jsonl):
    import datasets

    jsonl = write_jsonl(tmp_path / "a.jsonl", [{"q": "1+1?", "a": "2"}])
    json_file = write_jsonl(tmp_path / "b.json", [{"q": "2+2?", "a": "4"}])
    parquet = tmp_path / "c.parquet"
    datasets.Dataset.from_list([{"q": "3+3?", "a": "6"}]).to_parquet(str(parquet))
    csv = tmp_path / "d.CSV"
    csv.write_text("q,a\n4+4?,8\n")
    assert [local_file_builder(p) for p in (jsonl, json_file, parquet, csv)] == ["json", "json", "parquet", "csv"]
    both = load_local_files([jsonl, json_file], split="test")
    assert both["q"] == ["1+1?", "2+2?"] and both.split == "test"
    assert load_local_files(parquet)["a"] == ["6"]
    assert load_local_files(str(csv))["a"] == [8]
    assert is_local_data_file("x/y.JSONL") and not is_local_data_file("HuggingFaceH4/MATH-500")


def test_local_file_errors(tmp_path, write_jsonl):
    txt = tmp_path / "a.txt"
    txt.write_text("1+1?\n")
    with pytest.raises(ValueError, match=r"unsupported extension '.txt'; use one of .json, .jsonl, .parquet, .csv"):
        local_file_builder([str(txt)])
    with pytest.raises(FileNotFoundError, match=r"Data file '/no/file.jsonl' does not exist"):
        load_local_files("/no/file.jsonl")
    with pytest.raises(ValueError, match="data_files is empty"):
        local_file_builder([])
    csv = tmp_path / "b.csv"
    csv.write_text("q,a\n")
    with pytest.raises(ValueError, match=r"one format, got a mix of \['csv', 'json'\]"):
        local_file_builder([write_jsonl(tmp_path / "a.jsonl", [{"q": "1+1?", "a": "2"}]), str(csv)])
    # An empty file (or only blank lines), which `datasets` fails on with a bare StopIteration.
    for content in ("", "\n  \n"):
        (tmp_path / "empty.jsonl").write_text(content)
        with pytest.raises(ValueError, match=r"Data file '.*empty.jsonl' is empty; give a file with at least one row"):
            load_local_files(str(tmp_path / "empty.jsonl"))


# ----------------------------------------------------------------------------------------------------------------------
# Context length
# ----------------------------------------------------------------------------------------------------------------------


def test_context_length_from_a_path_a_config_and_vllm(tiny_model_path):
    from transformers import AutoConfig, LlavaConfig, PretrainedConfig, Qwen2Config

    assert model_context_length(tiny_model_path) == AutoConfig.from_pretrained(tiny_model_path).max_position_embeddings
    assert model_context_length(tiny_model_path) == 1024
    assert model_context_length(tiny_model_path, max_model_len=512) == 512  # vLLM's limit caps it
    assert model_context_length(tiny_model_path, max_model_len=4096) == 1024  # never raises it
    assert model_context_length(tiny_model_path, context_length=8192) == 8192  # the caller's word, config unread
    assert model_context_length("/no/such/model", context_length=300, max_model_len=200) == 200
    nested = LlavaConfig(text_config=Qwen2Config(max_position_embeddings=2048).to_dict())
    assert model_context_length(nested) == 2048  # a multimodal config's text model
    assert model_context_length(PretrainedConfig()) is None  # a config without max_position_embeddings
    with pytest.raises(OSError):
        model_context_length("/no/such/model")


# ----------------------------------------------------------------------------------------------------------------------
# Prompts
# ----------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def test_chat_prompts_render_with_the_generation_prompt(tokenizer):
    chats = [
        [{"role": "user", "content": "What is 1 + 1?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}],
    ]
    ids = render_prompts(tokenizer, chats)
    assert tokenizer.decode(ids[0]) == "<|im_start|>user\nWhat is 1 + 1?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(ids[1]).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2 + 2?")
    for chat, row in zip(chats, ids, strict=True):  # one by one or batched: the same ids
        (alone,) = render_prompts(tokenizer, [chat])
        assert alone == row
    assert render_prompts(tokenizer, []) == []


def test_text_prompts_are_tokenized_as_they_are(tokenizer):
    assert render_prompts(tokenizer, ["1 + 1 ="]) == [tokenizer("1 + 1 =")["input_ids"]]


def test_bad_prompts_are_explained(tokenizer):
    with pytest.raises(ValueError, match="Prompts mix chats and plain text .*prompt 1 is not"):
        render_prompts(tokenizer, ["text", [{"role": "user", "content": "chat"}]])
    template, tokenizer.chat_template = tokenizer.chat_template, None
    try:
        with pytest.raises(ValueError, match="has no chat template"):
            render_prompts(tokenizer, [[{"role": "user", "content": "hi"}]])
    finally:
        tokenizer.chat_template = template


# ----------------------------------------------------------------------------------------------------------------------
# Completions
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, text",
    [
        ("Answer: 42", "Answer: 42"),
        ([{"role": "assistant", "content": "Answer: 42"}], "Answer: 42"),  # what GRPOTrainer passes
        ({"role": "assistant", "content": "7"}, "7"),
        ([{"content": "3 + 4"}], "3 + 4"),  # no role: the assistant's
        (
            [{"role": "assistant", "content": [{"type": "text", "text": "Ans"}, {"type": "text", "text": "wer: 1"}]}],
            "Answer: 1",
        ),
        ([{"role": "assistant", "content": None}], ""),
        (
            [  # tool calling: assistant, tool, ..., assistant; only the final turn is the answer
                {"role": "assistant", "content": "Let me add.", "tool_calls": [{"type": "function"}]},
                {"role": "tool", "name": "add", "content": "41"},
                {"role": "assistant", "content": "Answer: 42"},
            ],
            "Answer: 42",
        ),
    ],
)
def test_completion_to_text(completion, text):
    assert completion_to_text(completion) == text


@pytest.mark.parametrize("completion", [42, [], [{"role": "tool", "content": "41"}], ["text"]])
def test_completion_to_text_refuses_other_shapes(completion):
    with pytest.raises(TypeError, match="a string or a list of chat messages ending in an assistant turn"):
        completion_to_text(completion)


def test_model_paths_are_checked_without_loading(tiny_model_path, tmp_path):
    from opefo_trl.model_io import check_model_name_or_path

    check_model_name_or_path(tiny_model_path)
    check_model_name_or_path("Qwen/Qwen2.5-Math-7B")  # a hub id: left to the hub (or its cache)
    with pytest.raises(FileNotFoundError, match=r"Model path '\./runs/nope' does not exist. Give a local model"):
        check_model_name_or_path("./runs/nope")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        check_model_name_or_path(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="is a file; give the model's directory"):
        check_model_name_or_path(str(tmp_path / "weights.bin"))
    with pytest.raises(ValueError, match="'bad name' is neither a local directory nor a valid hub id"):
        check_model_name_or_path("bad name")
