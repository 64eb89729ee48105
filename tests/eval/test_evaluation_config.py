"""opefo_trl.eval.config: EvaluationConfig refuses bad options when it is built."""

import pytest


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(prompt_template="chatml"), "Unknown prompt template 'chatml'"),
        (dict(top_p=0.0), "top_p must be in"),
        (dict(num_samples=0), "num_samples must be at least 1"),
        (dict(backend="tgi"), "Unknown backend 'tgi'"),
        (dict(benchmark_files=["aime24:/x.parquet"]), "NAME=PATH"),
        (dict(benchmark_files=["aime2024=/x.parquet"]), "benchmark 'aime2024' that is not registered"),
        (dict(model_name_or_path=None), "model_name_or_path is required"),
        (dict(math_reward_mode="final"), "math_reward_mode='final' is not a mode of the math reward"),
    ],
)
def test_invalid_options(overrides, message, bench_file, tmp_path, eval_config):
    with pytest.raises(ValueError, match=message):
        eval_config("m", bench_file, tmp_path, **overrides)
