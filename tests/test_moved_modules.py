"""The import paths of moved modules keep working for one release, with a DeprecationWarning naming the new home."""

import importlib
import sys

import pytest

# old module -> {new module: names the old one exported}
MOVED = {
    "opefo_trl.model_io": {
        "opefo_trl.data": ["LOCAL_FILE_BUILDERS", "is_local_data_file", "load_local_files", "local_file_builder"],
        "opefo_trl.model_files": [
            "check_model_name_or_path",
            "looks_like_local_path",
            "model_context_length",
            "weight_file_fingerprint",
            "weight_fingerprints",
        ],
        "opefo_trl.prompts": ["completion_to_text", "render_prompts"],
    },
    "opefo_trl.templates": {
        "opefo_trl.prompts": [
            "DAPO_USER_PROMPT",
            "DEFAULT_TEMPLATE",
            "PROBLEM_PLACEHOLDER",
            "PROMPT_TEMPLATES",
            "QWEN_MATH_SYSTEM_PROMPT",
            "PromptTemplate",
            "format_prompt",
            "get_template",
        ]
    },
    "opefo_trl.tiny": {
        "opefo_trl.testing": [
            "CHATML_TEMPLATE",
            "SPECIAL_TOKENS",
            "build_tiny_model",
            "build_tiny_tokenizer",
            "keep_rms_norm_in_model_dtype",
            "warm_up_tiny_model",
        ]
    },
    "opefo_trl.pass_at_k": {"opefo_trl.eval.pass_at_k": ["avg_at_n", "majority_vote", "mean_pass_at_k", "pass_at_k"]},
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_import_path_warns_and_gives_the_same_objects(old, monkeypatch):
    monkeypatch.delitem(sys.modules, old, raising=False)  # imported before (e.g. by the doctests): import it afresh
    with pytest.warns(DeprecationWarning, match=rf"{old} is deprecated.*import the same names from") as caught:
        module = importlib.import_module(old)
    for new, names in MOVED[old].items():
        assert new in str(caught[0].message)
        target = importlib.import_module(new)
        for name in names:
            assert getattr(module, name) is getattr(target, name), f"{old}.{name} is not {new}.{name}"
    assert sorted(module.__all__) == sorted(name for names in MOVED[old].values() for name in names)


def test_the_public_names_users_import_stay_where_they_were():
    import opefo_trl
    from opefo_trl.config import OPEFOConfig
    from opefo_trl.trainer import OPEFOTrainer

    assert opefo_trl.OPEFOConfig is OPEFOConfig and opefo_trl.OPEFOTrainer is OPEFOTrainer
    from opefo_trl.data import load_math_dataset  # noqa: F401
    from opefo_trl.methods import TokenMethod, register_token_method  # noqa: F401
    from opefo_trl.rewards import math_accuracy_reward, verify_completion  # noqa: F401
