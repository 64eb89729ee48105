"""Compare an `opefo-eval` store with `benchmarks/lighteval_task.py`'s details on the same problems: prompt token ids,
completions and scores, problem by problem (README, "Evaluation").

    opefo-eval --model_name_or_path MODEL_DIR --benchmarks benchmarks/arith20/arith20.jsonl --temperature 0 \\
        --max_new_tokens 128 --backend transformers --device cpu --dtype float32 --output_dir OPEFO_DIR
    python benchmarks/lighteval_task.py MODEL_DIR LIGHTEVAL_DIR          # in a lighteval==0.13.0 virtualenv
    python benchmarks/lighteval_compare.py MODEL_DIR OPEFO_DIR LIGHTEVAL_DIR/details.jsonl

Prints one row per problem and the agreement counts; also scores lighteval's completions with this package's
verifier (`math_accuracy_reward`'s), so that a score difference is told apart from a generation difference.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(model_dir: str, opefo_dir: str, lighteval_details: str) -> None:
    from transformers import AutoTokenizer

    from opefo_trl.data.rewards import verify_completion
    from opefo_trl.eval.benchmarks import Problem, build_prompt_ids

    with open(os.path.join(opefo_dir, "results.json")) as f:
        results = json.load(f)
    (benchmark,) = results["benchmarks"].values()
    rows = {row["problem_id"]: row for row in benchmark["problems"]}
    with open(os.path.join(opefo_dir, "samples.jsonl")) as f:
        samples = {r["problem_id"]: r for r in map(json.loads, f) if r["sample_index"] == 0}
    with open(lighteval_details) as f:
        light = {r["problem_id"]: r for r in map(json.loads, f)}
    if set(light) != set(rows):
        raise SystemExit(f"The runs hold different problems: opefo-eval {sorted(rows)}, lighteval {sorted(light)}.")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = sorted(rows)
    problems = [Problem(i, rows[i]["question"], rows[i]["gold"]) for i in ids]
    prompts = dict(zip(ids, build_prompt_ids(tokenizer, problems, results["config"]["prompt_template"]), strict=True))

    print(
        "| id | gold | same prompt | same completion | opefo-eval | lighteval | ours on lighteval's text | "
        "lighteval reads | opefo-eval reads |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    same_prompt = same_completion = same_score = 0
    ours_on_light = []
    for i in ids:
        prompt = light[i]["prompt_ids"]
        while prompt and prompt[0] == tokenizer.pad_token_id:  # lighteval pads on the left
            prompt = prompt[1:]
        theirs = light[i]["scores"]["pass@k:k=1&n=1"]
        ours = rows[i]["scores"][0]
        rescored = verify_completion(light[i]["completion"], rows[i]["gold"], results["config"]["math_reward_mode"])
        ours_on_light.append(rescored.score or 0.0)
        same_prompt += prompt == prompts[i]
        same_completion += light[i]["completion"] == samples[i]["completion"]
        same_score += theirs == ours
        extracted = (light[i]["extracted"] or ["-"])[0]
        print(
            f"| {i} | {rows[i]['gold']} | {prompt == prompts[i]} | {light[i]['completion'] == samples[i]['completion']}"
            f" | {ours} | {theirs} | {rescored.score} | {extracted} | {rows[i]['answers'][0]} |"
        )
    n = len(ids)
    print(
        f"\nprompts identical {same_prompt}/{n}, completions identical {same_completion}/{n}, "
        f"scores equal {same_score}/{n}"
    )
    print(
        f"pass@1: opefo-eval {sum(rows[i]['scores'][0] for i in ids) / n:.3f}, lighteval "
        f"{sum(light[i]['scores']['pass@k:k=1&n=1'] for i in ids) / n:.3f}, this package's verifier on "
        f"lighteval's completions {sum(ours_on_light) / n:.3f}"
    )


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    main(*sys.argv[1:])
