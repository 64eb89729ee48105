"""pass@k on the held-out targets: counts per target from the samples in generate's order, then the library's
unbiased estimator."""

import pytest
import torch

from opefo_trl.demo import HeldOutResult, evaluate_held_out
from opefo_trl.demo.tasks import TASKS
from opefo_trl.eval.pass_at_k import pass_at_k

pytestmark = pytest.mark.slow


class ScriptedModel(torch.nn.Module):
    """Stands in for a causal LM: ``generate`` returns the prompts followed by scripted answers (samples of one
    prompt together, prompts in order, as transformers returns num_return_sequences)."""

    def __init__(self, tokenizer, answers):
        super().__init__()
        self.tokenizer, self.answers, self.calls = tokenizer, answers, []

    @property
    def device(self):
        return torch.device("cpu")

    def generate(self, input_ids, attention_mask, num_return_sequences, max_new_tokens, **kwargs):
        self.calls.append(dict(num_return_sequences=num_return_sequences, max_new_tokens=max_new_tokens, **kwargs))
        completions = [self.tokenizer(a, add_special_tokens=False)["input_ids"] for a in self.answers]
        width = max(map(len, completions))
        pad = self.tokenizer.pad_token_id
        rows = [c + [pad] * (width - len(c)) for c in completions]
        prompts = input_ids.repeat_interleave(num_return_sequences, dim=0)
        return torch.cat([prompts, torch.tensor(rows)], dim=1)


def test_counts_and_pass_at_k_per_held_out_target(tiny_model_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    task = TASKS["digit_sum"]
    samples = 4
    right = {t: "9" * (t // 9) + str(t % 9) + "0" * (23 - t // 9) for t in task.held_out_targets}  # 24 digits
    assert all(task.exact_answer(a, t) is not None for t, a in right.items())
    # target i gets i right samples (two of them the same answer), the rest 23 digits
    answers = []
    for i, target in enumerate(task.held_out_targets):
        good = [right[target]] * min(i, samples)
        if i >= 2:
            good[1] = good[1][::-1]  # the same digits in another order: a distinct right answer
        answers += good + ["1" * 23] * (samples - len(good))
    model = ScriptedModel(tokenizer, answers).train()
    result = evaluate_held_out(model, tokenizer, task, samples, [1, 2, 4], max_new_tokens=24, seed=0)
    assert model.calls[0]["num_return_sequences"] == samples and model.calls[0]["do_sample"]
    assert model.calls[0]["temperature"] == 1.0 and model.calls[0]["max_new_tokens"] == 24
    correct = [min(i, samples) for i in range(6)]
    assert result.targets == task.held_out_targets and result.correct == correct
    assert result.distinct_correct == [0, 1, 2, 2, 2, 2]
    for k in (1, 2, 4):
        expected = sum(pass_at_k(samples, c, k) for c in correct) / 6
        assert result.pass_at_k[f"pass@{k}"] == pytest.approx(expected)
    assert result.accuracy == pytest.approx(sum(correct) / 24) == result.pass_at_k["pass@1"]
    assert model.training  # a policy sampled mid-training is put back in training mode


def test_from_counts_refuses_k_above_n():
    with pytest.raises(ValueError, match="pass@8 needs at least 8 samples"):
        HeldOutResult.from_counts([1], 4, [1], [1], [8])
