"""opefo_trl.data.loading: the hub loaders run offline on local stand-in files with the hub data sets' columns,
and local data files by extension."""

import json
import os
import re

import pytest
from datasets import Dataset

from opefo_trl.data import loading
from opefo_trl.data.loading import (
    DATASET_PRESETS,
    check_prompt_lengths,
    extract_boxed_answer,
    extract_gsm8k_answer,
    is_local_data_file,
    load_local_files,
    load_math_dataset,
    local_file_builder,
    prompt_token_lengths,
    resolve_dataset_source,
)
from opefo_trl.data.prompts import DAPO_USER_PROMPT, QWEN_MATH_SYSTEM_PROMPT, format_prompt


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


def _write_parquet(path, rows):
    Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


def _dapo_raw_row(problem, answer, index):
    return {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": DAPO_USER_PROMPT.replace("{problem}", problem)}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": str(index)},
    }


# ----------------------------------------------------------------------------------------------------------------------
# Answer extraction
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"Thus the answer is $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),
        (r"First \boxed{3}, then finally \boxed{x^{2}+1}", "x^{2}+1"),
        (r"nested \boxed{\sqrt{\frac{a}{b}}} done", r"\sqrt{\frac{a}{b}}"),
        (r"The total is $\boxed 5$.", "5"),
        (r"\fbox{12}", "12"),
        ("no boxed answer here", None),
        (r"unclosed \boxed{3", None),
        (r"empty \boxed{}", None),
    ],
)
def test_extract_boxed_answer(text, expected):
    assert extract_boxed_answer(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("She has 3 + 4 = <<3+4=7>>7 apples.\n#### 7", "7"),
        ("Cost: 1,200 + 300\n#### 1,500", "1500"),
        ("negative\n#### -3", "-3"),
        ("no final answer", None),
        ("#### ", None),
    ],
)
def test_extract_gsm8k_answer(text, expected):
    assert extract_gsm8k_answer(text) == expected


# ----------------------------------------------------------------------------------------------------------------------
# Presets on stand-in files
# ----------------------------------------------------------------------------------------------------------------------


def test_dapo_processed_parquet(tmp_path):
    rows = [  # the hub set's columns; source_prompt is the original chat
        {
            "prompt": problem,
            "solution": "2",
            "data_source": "math_dapo",
            "ability": "MATH",
            "source_prompt": [{"role": "user", "content": problem}],
        }
        for problem in ("What is $1+1$?", "Compute $\\frac{6}{3}$.")
    ]
    path = _write_parquet(tmp_path / "dapo.parquet", rows)
    ds = load_math_dataset("dapo-math-17k", template="qwen_math_boxed", data_files=[path])
    # The other columns are kept: TRL passes them to the reward functions.
    assert ds.column_names == ["prompt", "solution", "data_source", "ability", "source_prompt"]
    assert ds["solution"] == ["2", "2"] and ds["data_source"] == ["math_dapo"] * 2
    assert ds[0]["prompt"] == [
        {"role": "system", "content": QWEN_MATH_SYSTEM_PROMPT},
        {"role": "user", "content": "What is $1+1$?"},
    ]


def test_dapo_raw_deduplicates_and_unwraps_instruction(tmp_path):
    rows = [
        _dapo_raw_row("What is 2+2?", "4", 0),
        _dapo_raw_row("What is 3*3?", "9", 1),
        _dapo_raw_row("What is 2+2?", "4", 2),  # the raw set repeats each problem many times
        _dapo_raw_row("What is 3*3?", "9", 3),
        _dapo_raw_row("Find $x$ if $x-1=4$.", "5", 4),
    ]
    path = _write_parquet(tmp_path / "dapo_raw.parquet", rows)
    ds = load_math_dataset("dapo-math-17k-raw", template="dapo", data_files=[path])
    assert len(ds) == 3
    assert ds["solution"] == ["4", "9", "5"]
    # The `dapo` template puts DAPO's own instruction back verbatim: the prompt equals the raw chat.
    assert ds[0]["prompt"] == rows[0]["prompt"]
    plain = load_math_dataset("dapo-math-17k-raw", template="plain", data_files=[path])
    assert plain[2]["prompt"] == [{"role": "user", "content": "Find $x$ if $x-1=4$."}]
    kept_all = load_math_dataset("dapo-math-17k-raw", template="plain", data_files=[path], deduplicate=False)
    assert len(kept_all) == 5


def test_math_lighteval_takes_boxed_answer_and_drops_unanswerable(tmp_path, caplog):
    rows = [
        {"problem": "Half of 1?", "level": "Level 1", "type": "Algebra", "solution": r"It is $\boxed{\frac{1}{2}}$."},
        {"problem": "2+3?", "level": "Level 1", "type": "Algebra", "solution": r"We get $\boxed 5$."},
        {"problem": "Broken", "level": "Level 2", "type": "Algebra", "solution": "No box in this solution."},
    ]
    path = _write_jsonl(tmp_path / "math.jsonl", rows)
    with caplog.at_level("WARNING", logger=loading.__name__):
        ds = load_math_dataset("math-lighteval", template="plain", data_files=[path])
    assert ds["solution"] == [r"\frac{1}{2}", "5"]
    assert "Dropped 1 row(s)" in caplog.text and "first: row 2" in caplog.text


def test_gsm8k_answer_after_hashes(tmp_path):
    rows = [
        {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
        {"question": "A pen costs 1,000 cents; two pens?", "answer": "2 * 1,000 = 2,000\n#### 2,000"},
    ]
    path = _write_jsonl(tmp_path / "gsm8k.jsonl", rows)
    ds = load_math_dataset("gsm8k", template="qwen_math_boxed", data_files=[path])
    assert ds["solution"] == ["7", "2000"]
    assert ds[0]["prompt"][-1]["content"] == rows[0]["question"]


def test_hub_loaders_call_load_dataset_with_hub_id_and_config(tmp_path, monkeypatch):
    """Without data_files the presets download from the hub: check the id, config and split they ask for."""
    import datasets

    stand_ins = {
        "open-r1/DAPO-Math-17k-Processed": Dataset.from_list([{"prompt": "1+1?", "solution": "2"}]),
        "BytedTsinghua-SIA/DAPO-Math-17k": Dataset.from_list([_dapo_raw_row("1+1?", "2", 0)]),
        "DigitalLearningGmbH/MATH-lighteval": Dataset.from_list([{"problem": "1+1?", "solution": r"\boxed{2}"}]),
        "openai/gsm8k": Dataset.from_list([{"question": "1+1?", "answer": "#### 2"}]),
    }
    calls = []

    def fake_load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split))
        return stand_ins[path]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    for preset in ("dapo-math-17k", "dapo-math-17k-raw", "math-lighteval", "gsm8k"):
        ds = load_math_dataset(preset, template="plain", split="train")
        assert ds["solution"] == ["2"] and ds[0]["prompt"] == [{"role": "user", "content": "1+1?"}]
    assert calls == [
        ("open-r1/DAPO-Math-17k-Processed", "en", "train"),
        ("BytedTsinghua-SIA/DAPO-Math-17k", None, "train"),
        ("DigitalLearningGmbH/MATH-lighteval", None, "train"),
        ("openai/gsm8k", "main", "train"),
    ]


# ----------------------------------------------------------------------------------------------------------------------
# Local files with custom columns
# ----------------------------------------------------------------------------------------------------------------------


def test_local_csv_with_custom_columns_and_max_samples(tmp_path):
    path = tmp_path / "problems.csv"
    path.write_text("id,question,final\n1,What is 6*7?,42\n2,What is 10-3?,7\n3,What is 2^5?,32\n")
    ds = load_math_dataset(
        "local",
        template="plain",
        data_files=[str(path)],
        problem_column="question",
        answer_column="final",
        max_samples=2,
    )
    assert ds["solution"] == ["42", "7"]  # integers read by CSV become text
    assert ds[1]["prompt"] == [{"role": "user", "content": "What is 10-3?"}]


def test_local_answer_list_is_joined_as_the_verifier_reads_it(tmp_path):
    rows = [{"question": "Roots of x^2=1?", "final_answer": ["$-1$", "$1$"]}]
    path = _write_jsonl(tmp_path / "olympiad.jsonl", rows)
    ds = load_math_dataset(
        "local", template="plain", data_files=[path], problem_column="question", answer_column="final_answer"
    )
    assert ds["solution"] == ["-1, 1"]


def test_missing_column_names_column_and_available_ones(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"question": "1+1?", "answer": "2"}])
    with pytest.raises(ValueError) as err:
        load_math_dataset(
            "local", template="plain", data_files=[path], problem_column="problem", answer_column="answer"
        )
    message = str(err.value)
    assert "'problem'" in message and "question, answer" in message and "problem_column" in message


def test_missing_struct_field_names_it(tmp_path):
    row = _dapo_raw_row("1+1?", "2", 0)
    row["reward_model"] = {"style": "rule"}
    path = _write_parquet(tmp_path / "raw.parquet", [row])
    expected = r"'reward_model.ground_truth' is missing.*reward_model \(with fields style\)"
    with pytest.raises(ValueError, match=expected):
        load_math_dataset("dapo-math-17k-raw", template="plain", data_files=[path])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(name="some/hub-set"), "set `problem_column` and `answer_column`"),
        (dict(name="local", problem_column="q", answer_column="a"), "needs `data_files`"),
        (dict(name="gsm8k", answer_format="latex"), "answer_format must be one of"),
        (dict(name="gsm8k", data_files=["/no/such/file.jsonl"]), "does not exist"),
        (dict(name="gsm8k", template="chatml"), "Unknown prompt template 'chatml'"),
        (dict(name="gsm8k", max_samples=0), "max_samples must be at least 1"),
    ],
)
def test_bad_options_are_clear_errors(kwargs, message, tmp_path):
    kwargs = {"template": "plain", **kwargs}
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        load_math_dataset(**kwargs)


def test_unsupported_extension(tmp_path):
    path = tmp_path / "problems.txt"
    path.write_text("1+1?\n")
    with pytest.raises(ValueError, match=r"unsupported extension '.txt'"):
        load_math_dataset("local", template="plain", data_files=[str(path)], problem_column="q", answer_column="a")


def test_presets_and_overrides_resolve():
    assert set(DATASET_PRESETS) == {"dapo-math-17k", "dapo-math-17k-raw", "math-lighteval", "gsm8k"}
    source = resolve_dataset_source("gsm8k", config="socratic", answer_column="final")
    assert (source.hub_id, source.config, source.problem_column, source.answer_column, source.answer_format) == (
        "openai/gsm8k",
        "socratic",
        "question",
        "final",
        "gsm8k",
    )


# ----------------------------------------------------------------------------------------------------------------------
# Context-length check
# ----------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def _prompts(problems):
    prompts = [format_prompt(p, "plain") for p in problems]
    return Dataset.from_dict({"prompt": prompts, "solution": ["1"] * len(problems)})


def test_prompt_token_lengths_match_the_trainers_rendering(tiny_tokenizer):
    ds = _prompts(["What is 1 + 1?", "What is " + "1 + " * 30 + "1?"])
    lengths = prompt_token_lengths(ds, tiny_tokenizer)
    for row, length in zip(ds, lengths, strict=True):
        rendered = tiny_tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        assert length == len(tiny_tokenizer(rendered, add_special_tokens=False)["input_ids"])
    assert lengths[1] > lengths[0]


def test_overlong_prompt_is_an_error_or_dropped(tiny_tokenizer, caplog):
    ds = _prompts(["What is 1 + 1?", "What is " + "1 + " * 60 + "1?", "What is 2 + 2?"])
    short, long_ = sorted(prompt_token_lengths(ds, tiny_tokenizer))[::2]
    context = short + 10 + 1  # the short prompts fit with 10 completion tokens, the long one does not
    assert long_ > context - 10
    with pytest.raises(ValueError) as err:
        check_prompt_lengths(ds, tiny_tokenizer, max_completion_length=10, max_position_embeddings=context)
    message = str(err.value)
    assert "1 of 3 prompts" in message and f"longest: {long_} tokens, row 1" in message
    assert "drop_overlong_prompts" in message
    with caplog.at_level("WARNING", logger=loading.__name__):
        kept = check_prompt_lengths(
            ds, tiny_tokenizer, max_completion_length=10, max_position_embeddings=context, drop_overlong=True
        )
    assert kept["prompt"] == [ds[0]["prompt"], ds[2]["prompt"]]
    assert "dropping them" in caplog.text
    assert check_prompt_lengths(ds, tiny_tokenizer, max_completion_length=10, max_position_embeddings=long_ + 10) is ds


def test_completion_longer_than_context_is_an_error(tiny_tokenizer):
    with pytest.raises(ValueError, match=r"max_completion_length \(4096\) leaves no room"):
        check_prompt_lengths(
            _prompts(["1+1?"]), tiny_tokenizer, max_completion_length=4096, max_position_embeddings=4096
        )


def test_chat_problem_column_uses_last_user_turn_and_rejects_chats_without_one(tmp_path):
    good = {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 5 - 2?"}],
        "answer": "3",
    }
    bad = {"messages": [{"role": "system", "content": "Only a system turn."}], "answer": "1"}
    options = dict(template="plain", problem_column="messages", answer_column="answer")
    ds = load_math_dataset("local", data_files=[_write_jsonl(tmp_path / "good.jsonl", [good])], **options)
    assert ds[0]["prompt"] == [{"role": "user", "content": "What is 5 - 2?"}]
    with pytest.raises(ValueError, match=r"Row 1 of the problem column 'messages' is neither text nor a chat"):
        load_math_dataset("local", data_files=[_write_jsonl(tmp_path / "bad.jsonl", [good, bad])], **options)


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


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("rows.jsonl", '{"a": 1}\n\n{"a": 2\n', "'{path}', line 3, is not a JSON object (Expecting ',' delimiter"),
        ("rows.jsonl", '{"a": 1}\n[1, 2]\n', "'{path}', line 2, is not a JSON object (a list)"),
        ("rows.json", '[{"a": 1},\n {"a": 2]\n', "'{path}' is not valid JSON (Expecting ',' delimiter: line 2"),
    ],
)
def test_a_malformed_json_data_file_names_its_line(name, text, message, tmp_path):
    from opefo_trl.data.loading import local_file_builder

    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(message.format(path=path))):
        local_file_builder([str(path)])


def test_whole_json_documents_and_json_lines_pass(tmp_path):
    from opefo_trl.data.loading import load_local_files, local_file_builder

    rows = [{"a": 1}, {"a": 2}]
    for name, text in (
        ("lines.jsonl", "".join(json.dumps(r) + "\n" for r in rows)),
        ("array.json", json.dumps(rows, indent=1)),
        ("columns.json", json.dumps({"a": [1, 2]}, indent=1)),
    ):
        (tmp_path / name).write_text(text)
        assert local_file_builder([str(tmp_path / name)]) == "json"
    assert load_local_files([str(tmp_path / "lines.jsonl")])["a"] == [1, 2]
    assert load_local_files([str(tmp_path / "array.json")])["a"] == [1, 2]


@pytest.mark.slow
@pytest.mark.parametrize("variable", ["HF_HOME", "HOME"])
def test_an_unwritable_datasets_cache_is_one_line_before_loading_in_train_and_eval(
    variable, read_only_dir, tiny_model_path, problems_file, bench_file, tmp_path
):
    """A read-only HF_HOME, or an unwritable HOME with HF_HOME unset (its ~/.cache), broke both commands with an
    OSError traceback from datasets; each now names the cache and the variables that move it, exit 2, nothing
    written."""
    import subprocess
    import sys
    from pathlib import Path

    moved = ("HF_HOME", "HF_DATASETS_CACHE", "XDG_CACHE_HOME")
    environment = {k: v for k, v in os.environ.items() if k not in moved}
    environment.update(
        {"PYTHONPATH": str(Path(__file__).parents[2]), "HF_HUB_OFFLINE": "1", variable: str(read_only_dir)}
    )
    cache = read_only_dir / ("datasets" if variable == "HF_HOME" else ".cache/huggingface/datasets")
    model = ["--model_name_or_path", tiny_model_path]
    commands = {
        "opefo-train": [
            "opefo_trl.cli.train",
            *model,
            "--dataset_name",
            "local",
            "--dataset_files",
            problems_file,
            "--problem_column",
            "prompt",
            "--answer_column",
            "solution",
            "--output_dir",
            str(tmp_path / "train"),
            "--max_steps",
            "1",
            "--use_cpu",
            "true",
            "--bf16",
            "false",
            "--report_to",
            "none",
        ],  # fmt: skip
        "opefo-eval": [
            "opefo_trl.cli.evaluate",
            *model,
            "--benchmarks",
            bench_file,
            "--backend",
            "transformers",
            "--output_dir",
            str(tmp_path / "eval"),
        ],  # fmt: skip
    }
    for prog, argv in commands.items():
        done = subprocess.run([sys.executable, "-m", *argv], env=environment, capture_output=True, text=True)
        errors = [line for line in done.stderr.splitlines() if f"{prog}: error:" in line]
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert len(errors) == 1 and errors[0].startswith(
            f"{prog}: error: The datasets cache {cache} cannot be written ("
        )
        assert errors[0].endswith(
            "datasets stores every data set it loads there. Set HF_DATASETS_CACHE (or HF_HOME) to a folder this "
            "user can write to."
        )
    assert sorted(os.listdir(tmp_path)) == ["read-only"]
