"""Tiny local models and tokenizers: what every offline run of this repository trains.

Their users are the test suite (``tests/conftest.py``), the benchmarks (``benchmarks/``), the notebooks in smoke mode
(``OPEFO_SMOKE=1``) and the demo (``opefo_trl.demo``, whose warm start starts from :func:`build_tiny_model`); hence a
testing module next to the package's other layers rather than a part of any one of them (the float64 helpers below
serve the tests and benchmarks only).

Nothing here touches the model hub: a byte-level BPE tokenizer is trained on a small arithmetic corpus
with the ``tokenizers`` library, wrapped as a ChatML ``PreTrainedTokenizerFast``, and paired with a randomly
initialised ``Qwen2ForCausalLM``. Both are saved to a directory so that anything which reloads a model by
path (TRL's reference model when ``beta != 0``, ``opefo-train``, ``opefo-eval``) works offline.

Example:
    >>> from opefo_trl.testing import build_tiny_model
    >>> path = build_tiny_model("/tmp/tiny-qwen2")  # doctest: +SKIP
    >>> # GRPOConfig(...); OPEFOTrainer(model=path, ...)
"""

from __future__ import annotations

import os
import random

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _corpus(num_lines: int = 2000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = (
        "Please reason step by step, and put your final answer within \\boxed{}. "
        "Answer: the answer is what is compute solve find sum of plus minus times system user assistant"
    ).split()
    lines = []
    for _ in range(num_lines):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice(["+", "-", "*"])
        lines.append(f"What is {a} {op} {b}? Answer: {eval(f'{a}{op}{b}')} \\boxed{{{a + b}}}")
        lines.append(" ".join(rng.choices(words, k=8)))
    return lines


def build_tiny_tokenizer(vocab_size: int = 320):
    """A ChatML byte-level BPE tokenizer (eos ``<|im_end|>``, pad ``<|endoftext|>``, left padding)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        padding_side="left",
        chat_template=CHATML_TEMPLATE,
    )


def build_tiny_model(
    path: str | os.PathLike,
    *,
    vocab_size: int | None = None,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_key_value_heads: int | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = True,
    seed: int = 0,
) -> str:
    """Build and save a random Qwen2-shaped causal LM with its tokenizer under ``path``; return ``path``.

    ``vocab_size`` defaults to the tokenizer's size. A larger value (e.g. Qwen's 151,936) pads the embedding
    and LM head, which is what matters for cost; ids beyond the tokenizer decode to nothing.
    Reuses an existing build at ``path`` with the same settings.
    """
    import json

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = os.fspath(path)
    settings = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        seed=seed,
    )
    marker = os.path.join(path, "opefo_tiny.json")
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == settings:
                return path

    tokenizer = build_tiny_tokenizer()
    config = Qwen2Config(
        vocab_size=vocab_size or len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_key_value_heads or max(1, num_heads // 2),
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    with open(marker, "w") as f:
        json.dump(settings, f)
    return path


def warm_up_tiny_model(path: str | os.PathLike, output: str | os.PathLike, *, steps: int = 40, lr: float = 3e-3) -> str:
    """A few supervised AdamW steps of the model at ``path`` on fixed answers ("What is i + 1?" -> "i+1 1 2 3"),
    saved with its tokenizer under ``output``; return ``output``. The policy is then peaked and away from the entropy
    maximum, where a small step's first-order entropy change is not swamped by curvature (tests, benchmarks)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    texts = [
        f"<|im_start|>user\nWhat is {i} + 1?<|im_end|>\n<|im_start|>assistant\n{i + 1} 1 2 3<|im_end|>"
        for i in range(16)
    ]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    torch.manual_seed(0)
    for _ in range(steps):
        model(**batch, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    output = os.fspath(output)
    model.save_pretrained(output)
    tokenizer.save_pretrained(output)
    return output


def keep_rms_norm_in_model_dtype(model):
    """Qwen2's and Llama's RMSNorm compute in float32 whatever the model's dtype; patch them, in place, to compute in
    the dtype of their input, so that a float64 model is float64 throughout (float64 references in tests and
    benchmarks; rotary embeddings aside). Returns the model.

    transformers >= 5.25 kernelizes a model when the `kernels` package is installed (``use_kernels`` on by default):
    at load and again at every ``train()`` / ``eval()`` switch it sets the ``forward`` of each layer that has a hub
    kernel, RMSNorm among them, which would silently undo this patch at the first ``Trainer.train()``. Kernelization is
    turned off for this model first (its layers back to their torch code), so that the patch stays."""
    import types

    import torch
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    def rms_norm_in_input_dtype(self, hidden):
        return self.weight * hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)

    if getattr(model, "use_kernels", False):
        model.use_kernels = False
    for module in model.modules():
        if isinstance(module, (Qwen2RMSNorm, LlamaRMSNorm)):
            module.forward = types.MethodType(rms_norm_in_input_dtype, module)
    return model


def vllm_generation_emulated(trainer, sampling_logp: float = -5.75):
    """A context in which ``trainer`` (an ``OPEFOTrainer`` built without vLLM) runs TRL's vLLM rollout with
    importance-sampling correction, but samples with transformers: TRL's ``_generate`` returns made-up sampling
    log-probs (``sampling_logp`` +/- 0.1) in place of vLLM's, and the rest of TRL's rollout runs as with vLLM (its
    old-log-prob pass, the importance ratio, the corrected loss); the trainer's parts are set as
    ``build_parts`` sets them for vLLM. For tests and ``benchmarks/weight_path.py``; vLLM itself: ``make test-vllm``."""
    from unittest import mock

    from trl import GRPOTrainer

    generate = GRPOTrainer._generate

    def with_sampling_logps(self, prompts):
        self.use_vllm = False
        try:
            output = list(generate(self, prompts))
        finally:
            self.use_vllm = True
        output[4] = [[sampling_logp + 0.1 * (j % 3 - 1) for j in range(len(ids))] for ids in output[1]]
        return tuple(output)

    trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
    trainer.loss_mirror.importance_sampling_correction = True
    if trainer.rollout is not None:
        trainer.rollout.trl_scores_rollout, trainer.rollout.generation = True, None
    return mock.patch.object(GRPOTrainer, "_generate", with_sampling_logps)
