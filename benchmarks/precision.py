"""Precision of the entropy-flow statistics in the recipes' training precisions, on a peaked model, against float64.

What lambda* balances is computed from log pi_t, H_t (and, for `full`, two vocabulary sums) of the current policy.
On a random model (H ~ 11.9 nats over a 151,936-token vocabulary) bf16 rounding barely moves lambda*; on the peaked
distributions of a trained model it may. This measures it on the path the trainer really uses:

1. a model is warm-started (a few hundred supervised steps, full-vocabulary softmax through TRL's fused LM head) on
   a synthetic task, a Markov chain over token ids spread over the whole vocabulary whose states have 1 to
   `max_successors` successors, so that token entropies are 0.1-3 nats;
2. one rollout is sampled from it (temperature 1, no top-k / top-p), with fixed advantages: group-normalised rewards
   (TRL's `scale_rewards="group"`) of a synthetic reward, the fraction of even token ids (`even_token_reward`);
3. float64 reference: the weights cast to float64, eager attention, RMSNorm in float64 too
   (`opefo_trl.testing.keep_rms_norm_in_model_dtype`), the log-softmax chunked over tokens so the
   [tokens, vocab] logits never exceed `reference_token_chunk` rows;
4. each precision mode (`MODES`): the model loaded by TRL's GRPOTrainer with that mode's dtype, bf16 and
   `cast_lm_head_to_fp32` (so TRL's own head casting and fused LM head are used), log pi_t and H_t from TRL's
   scoring pass (`GRPOTrainer._get_per_token_logps_and_entropies`, under the accelerator's autocast as in training),
   sum pi^2 and sum pi^2 log pi from `opefo_trl.maths.vocab_stats.vocab_stats` on the backbone's hidden states with the
   compute dtype OPEFOTrainer picks for them (fp32 with `cast_lm_head_to_fp32`, else the autocast dtype, else the
   hidden states' dtype);
5. for each estimate (`opefo`, `full`): the flows d_t = A_t u_t (`opefo_trl.maths.entropy_flow.entropy_flow`), P, N
   (`flow_stats`) and lambda* of each mode against the reference, their errors, and the per-token sign agreement of
   d_t; the same on disjoint blocks of the rollout (does the error shrink with more tokens?);
6. through OPEFOTrainer itself (its logged metrics, every `entropy_flow/*` and `opefo/*` one): the `param`
   estimate at learning rate `audit_learning_rate` with the audit every step (its check error, predicted vs
   measured entropy change), and the audit's noise floor at learning rate 0 in bf16 (autocast over fp32 weights,
   and pure bf16 weights).

The reference's flows go through the same library functions as the modes' (their formulas run in float32 on float64
statistics): the comparison isolates the precision of the statistics, which is what a training precision changes.
For `bf16_weights*` the reference is the float64 copy of the fp32 weights (DeepSpeed's master weights), so the
rounding of the weights to bf16 is part of the error.

    python benchmarks/precision.py --output_dir runs/precision   # CPU: tiny backbone, Qwen's vocabulary, 128 x 128
    python benchmarks/precision.py --output_dir runs/precision-small --vocab_size 4096 --completions 32 \\
        --warm_start_steps 100 --trainer_runs false                      # a quick look

Writes OUTPUT_DIR/precision.json (as it goes) and OUTPUT_DIR/precision.md.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

#: name -> how the policy is held and projected: weights dtype, bf16 autocast (accelerate's `bf16`), and TRL's
#: `cast_lm_head_to_fp32` (the LM head, hence the flow statistics, in fp32).
MODES = {
    "fp32": dict(dtype="float32", bf16=False, cast_lm_head_to_fp32=False),
    "bf16_autocast": dict(dtype="float32", bf16=True, cast_lm_head_to_fp32=False),  # DDP recipes
    "bf16_weights": dict(dtype="bfloat16", bf16=False, cast_lm_head_to_fp32=False),  # DeepSpeed recipes
    "bf16_autocast_fp32_head": dict(dtype="float32", bf16=True, cast_lm_head_to_fp32=True),
    "bf16_weights_fp32_head": dict(dtype="bfloat16", bf16=False, cast_lm_head_to_fp32=True),
}
ESTIMATES = ("opefo", "full")
#: The lambda* error above which a precision mode is reported as not good enough for lambda* ~ 1e-3 (the paper's).
LAMBDA_TOLERANCE = 1e-4
STAT_NAMES = ("logps", "entropies", "sum_sq_probs", "sum_sq_probs_log_probs")


@dataclass
class PrecisionSettings:
    """What `precision.py` measures (defaults: the CPU measurement, a tiny backbone with Qwen's vocabulary)."""

    output_dir: str = field(default="precision", metadata={"help": "Where precision.json and precision.md go."})
    work_dir: str | None = field(
        default=None, metadata={"help": "Where the warm-started model is kept (reused by later runs); default: temp."}
    )
    vocab_size: int = field(default=151_936, metadata={"help": "Vocabulary (Qwen's: 151,936)."})
    hidden_size: int = field(default=64, metadata={"help": "Hidden size of the Qwen2-shaped model."})
    num_layers: int = field(default=2, metadata={"help": "Decoder layers."})
    num_heads: int = field(default=4, metadata={"help": "Attention heads."})
    num_key_value_heads: int | None = field(default=None, metadata={"help": "Key/value heads (default heads / 2)."})
    intermediate_size: int | None = field(default=None, metadata={"help": "MLP size (default 2 x hidden)."})
    chain_states: int = field(default=64, metadata={"help": "Token ids the synthetic Markov chain visits."})
    max_successors: int = field(default=24, metadata={"help": "Most successors of a chain state (entropy spread)."})
    warm_start_steps: int = field(default=200, metadata={"help": "Supervised AdamW steps on chain samples."})
    warm_start_batch: int = field(default=8, metadata={"help": "Sequences per warm-start step."})
    warm_start_lr: float = field(default=1e-2, metadata={"help": "Peak learning rate of the warm start."})
    warm_start_positions: int = field(
        default=16, metadata={"help": "Completion positions per sequence scored in a warm-start step (random)."}
    )
    completions: int = field(default=128, metadata={"help": "Completions of the measured rollout."})
    num_generations: int = field(default=8, metadata={"help": "Completions per prompt (group of the advantages)."})
    completion_length: int = field(default=128, metadata={"help": "Tokens per completion."})
    block_completions: int = field(
        default=32, metadata={"help": "Completions per disjoint block of the error-vs-tokens comparison."}
    )
    modes: list[str] = field(default_factory=lambda: list(MODES), metadata={"help": f"Among {list(MODES)}."})
    estimates: list[str] = field(default_factory=lambda: list(ESTIMATES), metadata={"help": "Tabular estimates."})
    reference_token_chunk: int = field(default=128, metadata={"help": "Tokens per float64 log-softmax chunk."})
    score_batch_size: int = field(default=16, metadata={"help": "Completions per scoring forward of a mode."})
    trainer_runs: bool = field(
        default=True, metadata={"help": "Also run OPEFOTrainer: the `param` estimate and the audit's noise floor."}
    )
    trainer_completions: int = field(default=8, metadata={"help": "Completions per optimizer step of those runs."})
    trainer_num_generations: int = field(default=4, metadata={"help": "Completions per prompt in those runs."})
    trainer_completion_length: int = field(default=64, metadata={"help": "Tokens per completion in those runs."})
    trainer_steps: int = field(default=3, metadata={"help": "Optimizer steps of each of those runs."})
    trainer_bf16: bool = field(
        default=True, metadata={"help": "The `param` run in bf16 autocast over fp32 weights (the DDP recipes)."}
    )
    audit_learning_rate: float = field(default=1e-5, metadata={"help": "Learning rate of the `param` run."})
    seed: int = field(default=0, metadata={"help": "Seed of the task, the warm start and the rollout."})

    def __post_init__(self):
        unknown = [m for m in self.modes if m not in MODES]
        if unknown:
            raise ValueError(f"Unknown precision mode(s) {unknown}; choose among {list(MODES)}.")
        unknown = [e for e in self.estimates if e not in ESTIMATES]
        if unknown:
            raise ValueError(f"Unknown estimate(s) {unknown}; choose among {list(ESTIMATES)} (tabular estimates).")
        if self.completions % self.num_generations or self.block_completions % self.num_generations:
            raise ValueError(
                f"completions ({self.completions}) and block_completions ({self.block_completions}) must be multiples "
                f"of num_generations ({self.num_generations}): advantages are normalised per group."
            )
        if self.trainer_completions % 2 or self.trainer_completions % self.trainer_num_generations:
            raise ValueError(
                f"trainer_completions ({self.trainer_completions}) must be even (two micro-batches) and a multiple of "
                f"trainer_num_generations ({self.trainer_num_generations})."
            )
        for name in ("warm_start_steps", "completions", "completion_length", "trainer_steps", "chain_states"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")


def even_token_reward(completion_ids, **kwargs):
    """The fraction of even token ids in each completion: synthetic, varied within a group, needs no decoding."""
    return [sum(1 for i in ids if i % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


def group_advantages(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """TRL's `scale_rewards="group"` advantages: (r - group mean) / (group std + 1e-4), unbiased std."""
    grouped = rewards.view(-1, num_generations)
    centred = grouped - grouped.mean(1, keepdim=True)
    return (centred / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)


# ----------------------------------------------------------------------------------------------------------------------
# The synthetic task and the warm start
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class ChainTask:
    """A first-order Markov chain over `states` (token ids); state i moves to `successors[i, j]` w.p. `probs[i, j]`."""

    states: torch.Tensor  # (K,) token ids
    successors: torch.Tensor  # (K, S) indices into states
    probs: torch.Tensor  # (K, S), rows sum to 1 (zeros pad states with fewer successors)
    prompts: list[str]  # text prompts of one token length
    prompt_ids: torch.Tensor  # (len(prompts), P)

    @classmethod
    def build(cls, settings: PrecisionSettings, tokenizer) -> ChainTask:
        gen = torch.Generator().manual_seed(settings.seed)
        first_free = len(tokenizer)  # ids past the tokenizer decode to nothing: the chain cannot spell a prompt
        available = settings.vocab_size - first_free
        if available < 2:
            raise ValueError(f"vocab_size {settings.vocab_size} leaves no ids past the tokenizer's {first_free}.")
        count = min(settings.chain_states, available)
        states = first_free + torch.randperm(available, generator=gen)[:count]
        width = min(settings.max_successors, count)
        # log-uniform successor counts: entropies from 0 (one successor) to ~log(width)
        sizes = torch.exp(torch.rand(count, generator=gen) * math.log(width)).round().clamp(1, width).long()
        successors = torch.stack([torch.randperm(count, generator=gen)[:width] for _ in range(count)])
        with torch.random.fork_rng(devices=[]):  # Gamma draws from the global generator: seed it, then restore it
            torch.manual_seed(settings.seed)
            weights = torch.distributions.Gamma(torch.full((count, width), 0.7), 1.0).sample()
        weights = weights * (torch.arange(width) < sizes[:, None])
        probs = weights / weights.sum(1, keepdim=True)
        prompts, prompt_ids = _prompts_of_one_length(tokenizer, 256, gen)
        return cls(states, successors, probs, prompts, prompt_ids)

    def sample(self, count: int, length: int, gen: torch.Generator) -> torch.Tensor:
        """(count, length) token ids of chain walks from uniformly drawn start states."""
        index = torch.randint(len(self.states), (count,), generator=gen)
        walk = [index]
        for _ in range(length - 1):
            choice = torch.multinomial(self.probs[index], 1, generator=gen)[:, 0]
            index = self.successors[index, choice]
            walk.append(index)
        return self.states[torch.stack(walk, 1)]

    def entropy(self) -> torch.Tensor:
        """Per-state entropy of the chain's next-token distribution (nats)."""
        p = self.probs
        return -(p * p.clamp(min=1e-30).log()).sum(1)


def _prompts_of_one_length(tokenizer, count: int, gen: torch.Generator):
    """Arithmetic prompts whose tokenisations have the most common length (no padding anywhere)."""
    texts = [f"What is {a} + {b}?" for a, b in torch.randint(10, 100, (4 * count, 2), generator=gen).tolist()]
    encoded = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    length = statistics.mode(len(e) for e in encoded)
    kept = [(t, e) for t, e in zip(texts, encoded, strict=True) if len(e) == length][:count]
    return [t for t, _ in kept], torch.tensor([e for _, e in kept])


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def warm_start(settings: PrecisionSettings, path: str) -> dict:
    """Build a Qwen2-shaped model under `path` and train it on chain walks after a prompt; reuse an identical build."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opefo_trl.testing import build_tiny_model

    keys = (
        "vocab_size", "hidden_size", "num_layers", "num_heads", "num_key_value_heads", "intermediate_size",
        "chain_states", "max_successors", "warm_start_steps", "warm_start_batch", "warm_start_lr",
        "warm_start_positions", "completion_length", "seed",
    )  # fmt: skip
    marker = os.path.join(path, "opefo_warm_start.json")
    wanted = {k: getattr(settings, k) for k in keys}
    if os.path.exists(marker):
        with open(marker) as f:
            saved = json.load(f)
        if saved["settings"] == wanted:
            return {**saved["report"], "reused": True}
    build_tiny_model(
        path,
        vocab_size=settings.vocab_size,
        hidden_size=settings.hidden_size,
        num_layers=settings.num_layers,
        num_heads=settings.num_heads,
        num_key_value_heads=settings.num_key_value_heads,
        intermediate_size=settings.intermediate_size,
        max_position_embeddings=64 + settings.completion_length + max(settings.trainer_completion_length, 0),
        seed=settings.seed,
    )
    device = _device()
    tokenizer = AutoTokenizer.from_pretrained(path)
    task = ChainTask.build(settings, tokenizer)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    model.train()
    head = model.get_output_embeddings()
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.warm_start_lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, settings.warm_start_steps // 10)

    def schedule(step):  # linear warm-up, cosine decay to 0
        return min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / settings.warm_start_steps))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    gen = torch.Generator().manual_seed(settings.seed + 1)
    prompt_length, length = task.prompt_ids.shape[1], settings.completion_length
    positions = min(settings.warm_start_positions, length)
    start, losses = time.perf_counter(), []
    for _ in range(settings.warm_start_steps):
        rows = torch.randint(len(task.prompts), (settings.warm_start_batch,), generator=gen)
        ids = torch.cat([task.prompt_ids[rows], task.sample(settings.warm_start_batch, length, gen)], 1).to(device)
        # A random subset of the completion positions per sequence is scored: the full-vocabulary softmax is the
        # cost, and every position of every sequence is trained over the steps.
        picked = torch.rand(settings.warm_start_batch, length, generator=gen).argsort(1)[:, :positions]
        picked = (prompt_length + picked).to(device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            hidden = model.model(input_ids=ids).last_hidden_state
            predictors = hidden.gather(1, (picked - 1)[..., None].expand(-1, -1, hidden.shape[-1]))
            logits = head(predictors).float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.gather(1, picked).flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.save_pretrained(path)
    tail = losses[-max(1, len(losses) // 10) :]
    every = max(1, len(losses) // 10)
    report = dict(
        steps=settings.warm_start_steps,
        seconds=time.perf_counter() - start,
        first_loss=losses[0],
        final_loss=sum(tail) / len(tail),
        loss_curve={str(i + 1): losses[i] for i in range(every - 1, len(losses), every)},
        chain_mean_entropy=float(task.entropy().mean()),
        reused=False,
    )
    with open(marker, "w") as f:
        json.dump({"settings": wanted, "report": report}, f)
    return report


# ----------------------------------------------------------------------------------------------------------------------
# The rollout, the float64 reference and the precision modes
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class Rollout:
    prompt_ids: torch.Tensor  # (B, P)
    completion_ids: torch.Tensor  # (B, T)
    completion_mask: torch.Tensor  # (B, T)
    rewards: torch.Tensor  # (B,)
    advantages: torch.Tensor  # (B,)

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.completion_ids], 1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([torch.ones_like(self.prompt_ids), self.completion_mask], 1)


@torch.no_grad()
def sample_rollout(settings: PrecisionSettings, path: str) -> Rollout:
    """`completions` samples (temperature 1, full distribution, exactly `completion_length` tokens) of the model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = _device()
    tokenizer = AutoTokenizer.from_pretrained(path)
    task = ChainTask.build(settings, tokenizer)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    gen = torch.Generator().manual_seed(settings.seed + 2)
    groups = settings.completions // settings.num_generations
    rows = torch.randperm(len(task.prompts), generator=gen)[:groups].repeat_interleave(settings.num_generations)
    prompt_ids = task.prompt_ids[rows]
    torch.manual_seed(settings.seed + 3)
    completions = []
    for chunk in prompt_ids.split(64):
        out = model.generate(
            input_ids=chunk.to(device),
            attention_mask=torch.ones_like(chunk).to(device),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=settings.completion_length,
            min_new_tokens=settings.completion_length,
            pad_token_id=tokenizer.pad_token_id,
        )
        completions.append(out[:, chunk.shape[1] :].cpu())
    completion_ids = torch.cat(completions)
    rewards = torch.tensor(even_token_reward(completion_ids.tolist()))
    return Rollout(
        prompt_ids=prompt_ids,
        completion_ids=completion_ids,
        completion_mask=torch.ones_like(completion_ids),
        rewards=rewards,
        advantages=group_advantages(rewards, settings.num_generations),
    )


@torch.no_grad()
def reference_statistics(settings: PrecisionSettings, path: str, rollout: Rollout) -> dict[str, torch.Tensor]:
    """(B, T) float64 log pi_t, H_t, sum pi^2, sum pi^2 log pi of the float64 copy of the weights (eager attention)."""
    from transformers import AutoModelForCausalLM

    device = _device()
    from opefo_trl.testing import keep_rms_norm_in_model_dtype

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="eager")
    model = keep_rms_norm_in_model_dtype(model).to(device).eval()  # Qwen2's RMSNorm would compute in float32
    head = model.get_output_embeddings()
    length = rollout.completion_ids.shape[1]
    out = {name: [] for name in STAT_NAMES}
    for ids, mask, targets in zip(
        rollout.input_ids.split(settings.score_batch_size),
        rollout.attention_mask.split(settings.score_batch_size),
        rollout.completion_ids.split(settings.score_batch_size),
        strict=True,
    ):
        hidden = model.model(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
        hidden = hidden[:, -length - 1 : -1].reshape(-1, hidden.shape[-1])
        flat_targets = targets.reshape(-1).to(device)
        parts = {name: [] for name in STAT_NAMES}
        chunk = settings.reference_token_chunk
        for h, t in zip(hidden.split(chunk), flat_targets.split(chunk), strict=True):
            logits = h @ head.weight.T
            if head.bias is not None:
                logits += head.bias
            logp = torch.log_softmax(logits, -1)
            del logits
            p = logp.exp()
            parts["logps"].append(logp.gather(1, t[:, None])[:, 0])
            parts["entropies"].append(-(p * logp).sum(-1))
            p.square_()
            parts["sum_sq_probs"].append(p.sum(-1))
            parts["sum_sq_probs_log_probs"].append((p * logp).sum(-1))
            del logp, p
        for name in STAT_NAMES:
            out[name].append(torch.cat(parts[name]).view(len(ids), length).cpu())
    return {name: torch.cat(v) for name, v in out.items()}


def _prompt_dataset(prompts: list[str]):
    from datasets import Dataset

    return Dataset.from_list([{"prompt": p} for p in prompts])


def _trainer_settings(settings: PrecisionSettings, output_dir: str, **overrides) -> dict:
    cuda = torch.cuda.is_available()
    base = dict(
        output_dir=output_dir,
        per_device_train_batch_size=settings.trainer_num_generations,
        num_generations=settings.trainer_num_generations,
        max_completion_length=settings.trainer_completion_length,
        temperature=1.0,
        use_cpu=not cuda,
        report_to="none",
        save_strategy="no",
        seed=settings.seed,
        disable_tqdm=True,
        logging_steps=1,
    )
    base.update(overrides)
    return base


@torch.no_grad()
def mode_statistics(settings: PrecisionSettings, path: str, rollout: Rollout, mode: str) -> dict[str, torch.Tensor]:
    """(B, T) statistics of `rollout` as a training run in precision `mode` computes them (see the module doc)."""
    from trl import GRPOConfig, GRPOTrainer

    from opefo_trl.maths.vocab_stats import vocab_stats
    from opefo_trl.trainer.config import OPEFOConfig

    spec = MODES[mode]
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = GRPOConfig(
            **_trainer_settings(settings, out),
            bf16=spec["bf16"],
            cast_lm_head_to_fp32=spec["cast_lm_head_to_fp32"],
            model_init_kwargs={"dtype": spec["dtype"]},
        )
        trainer = GRPOTrainer(
            model=path, reward_funcs=even_token_reward, args=args, train_dataset=_prompt_dataset(["x"] * 4)
        )
    model = trainer.model.eval()
    device = trainer.accelerator.device
    hidden_chunks = []
    handle = model.base_model.register_forward_hook(
        lambda module, args, output: hidden_chunks.append(output.last_hidden_state)
    )
    length = rollout.completion_ids.shape[1]
    logps, entropies, vocab = [], [], {"sum_sq_probs": [], "sum_sq_probs_log_probs": []}
    fields = OPEFOConfig.__dataclass_fields__
    head = model.get_output_embeddings()
    try:
        for ids, mask in zip(
            rollout.input_ids.split(settings.score_batch_size),
            rollout.attention_mask.split(settings.score_batch_size),
            strict=True,
        ):
            hidden_chunks.clear()
            with trainer.accelerator.autocast():
                lp, ent, _ = GRPOTrainer._get_per_token_logps_and_entropies(
                    trainer, model, ids.to(device), mask.to(device), length, compute_entropy=True
                )
                autocast_on = torch.is_autocast_enabled(device.type)
                autocast_dtype = torch.get_autocast_dtype(device.type)
            hidden = torch.cat(hidden_chunks)[:, -length - 1 : -1]
            # OPEFOTrainer's choice for the `full` statistics: TRL's fused-head precision.
            if spec["cast_lm_head_to_fp32"]:
                compute_dtype = torch.float32
            else:
                compute_dtype = autocast_dtype if autocast_on else hidden.dtype
            stats = vocab_stats(
                hidden,
                head.weight,
                head.bias,
                temperature=trainer.temperature,
                compute_dtype=compute_dtype,
                token_chunk_size=fields["vocab_stats_token_chunk_size"].default,
                vocab_chunk_size=fields["vocab_stats_vocab_chunk_size"].default,
            )
            logps.append(lp.float().cpu())
            entropies.append(ent.float().cpu())
            vocab["sum_sq_probs"].append(stats.sum_sq_probs.cpu())
            vocab["sum_sq_probs_log_probs"].append(stats.sum_sq_probs_log_probs.cpu())
    finally:
        handle.remove()
    weights_dtype = str(next(model.model.layers.parameters()).dtype)
    head_dtype = str(head.weight.dtype)
    del trainer, model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    out = dict(logps=torch.cat(logps), entropies=torch.cat(entropies), **{k: torch.cat(v) for k, v in vocab.items()})
    out["_dtypes"] = dict(
        weights=weights_dtype, head=head_dtype, vocab_stats_compute=str(compute_dtype), autocast=autocast_on
    )
    return out


# ----------------------------------------------------------------------------------------------------------------------
# Comparison
# ----------------------------------------------------------------------------------------------------------------------


def _flow_figures(stats: dict, rollout: Rollout, estimate: str, rows=slice(None)):
    from opefo_trl.maths.entropy_flow import entropy_flow, flow_stats

    moment2 = None
    if estimate == "full":  # S_2 = sum pi^2 log pi + H sum pi^2
        moment2 = stats["sum_sq_probs_log_probs"][rows] + stats["entropies"][rows] * stats["sum_sq_probs"][rows]
    flow = entropy_flow(stats["logps"][rows], stats["entropies"][rows], rollout.advantages[rows], estimate, moment2)
    sums = flow_stats(flow, rollout.completion_mask[rows].float())
    return flow, dict(lambda_star=float(sums.lambda_star), increase=float(sums.increase), decrease=float(sums.decrease))


def compare(reference: dict, stats: dict, rollout: Rollout, settings: PrecisionSettings) -> dict:
    """Per estimate: lambda*, P, N of the mode and the reference, their errors, sign agreement, errors per block."""
    mask = rollout.completion_mask.bool()
    per_token = {}
    for name in STAT_NAMES:
        error = (stats[name].double() - reference[name])[mask].abs()
        scale = reference[name][mask].abs().clamp(min=1e-30)
        per_token[name] = dict(
            median_abs_error=float(error.median()),
            max_abs_error=float(error.max()),
            median_rel_error=float((error / scale).median()),
        )
    estimates = {}
    blocks = range(0, len(rollout.advantages), settings.block_completions)
    for estimate in settings.estimates:
        flow, mine = _flow_figures(stats, rollout, estimate)
        flow_ref, ref = _flow_figures(reference, rollout, estimate)
        moving = mask & (rollout.advantages[:, None] != 0)
        block_errors = []
        for start in blocks:
            rows = slice(start, start + settings.block_completions)
            _, block = _flow_figures(stats, rollout, estimate, rows)
            _, block_ref = _flow_figures(reference, rollout, estimate, rows)
            block_errors.append(abs(block["lambda_star"] - block_ref["lambda_star"]))
        lambda_error = abs(mine["lambda_star"] - ref["lambda_star"])
        estimates[estimate] = dict(
            lambda_star=mine["lambda_star"],
            lambda_star_reference=ref["lambda_star"],
            lambda_abs_error=lambda_error,
            lambda_error_above_tolerance=lambda_error > LAMBDA_TOLERANCE,
            increase=mine["increase"],
            increase_reference=ref["increase"],
            increase_rel_error=abs(mine["increase"] - ref["increase"]) / max(ref["increase"], 1e-300),
            decrease=mine["decrease"],
            decrease_reference=ref["decrease"],
            decrease_rel_error=abs(mine["decrease"] - ref["decrease"]) / max(ref["decrease"], 1e-300),
            sign_agreement=float((torch.sign(flow) == torch.sign(flow_ref))[moving].double().mean()),
            tokens=int(moving.sum()),
            block_tokens=settings.block_completions * rollout.completion_ids.shape[1],
            block_lambda_abs_errors=block_errors,
        )
    return dict(per_token=per_token, estimates=estimates)


def entropy_summary(reference: dict, rollout: Rollout) -> dict:
    entropies = reference["entropies"][rollout.completion_mask.bool()]
    q = torch.quantile(entropies.float(), torch.tensor([0.1, 0.5, 0.9])).tolist()
    return dict(
        mean=float(entropies.mean()),
        p10=q[0],
        median=q[1],
        p90=q[2],
        fraction_in_0p1_to_3=float(((entropies >= 0.1) & (entropies <= 3.0)).double().mean()),
    )


# ----------------------------------------------------------------------------------------------------------------------
# Through OPEFOTrainer: the `param` estimate and the audit's noise floor
# ----------------------------------------------------------------------------------------------------------------------

TRAINER_RUNS = {
    # name -> OPEFOConfig fields on top of _trainer_settings; "lr" is filled from the settings
    "param": dict(entropy_flow_estimate="param", dtype="float32", bf16=None, lr="audit"),
    "floor_bf16_autocast": dict(entropy_flow_estimate="param", dtype="float32", bf16=True, lr=0.0),
    "floor_bf16_weights": dict(entropy_flow_estimate="opefo", dtype="bfloat16", bf16=False, lr=0.0),
}


def trainer_run(settings: PrecisionSettings, path: str, name: str, work: str) -> dict:
    """Train OPEFOTrainer for `trainer_steps` steps with the audit every step; every logged entropy_flow/* and
    opefo/* metric, per step."""
    from transformers import AutoTokenizer

    from opefo_trl import OPEFOConfig, OPEFOTrainer

    spec = dict(TRAINER_RUNS[name])
    bf16 = settings.trainer_bf16 if spec["bf16"] is None else spec["bf16"]
    learning_rate = settings.audit_learning_rate if spec["lr"] == "audit" else spec["lr"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    task = ChainTask.build(settings, tokenizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = OPEFOConfig(
            **_trainer_settings(
                settings,
                os.path.join(work, name),
                per_device_train_batch_size=settings.trainer_completions // 2,
                gradient_accumulation_steps=2,
            ),
            method="opefo",
            entropy_flow_estimate=spec["entropy_flow_estimate"],
            entropy_flow_audit_steps=1,
            learning_rate=learning_rate,
            lr_scheduler_type="constant",
            max_steps=settings.trainer_steps,
            bf16=bf16,
            model_init_kwargs={"dtype": spec["dtype"]},
        )
        trainer = OPEFOTrainer(
            model=path, reward_funcs=even_token_reward, args=args, train_dataset=_prompt_dataset(task.prompts)
        )
        start = time.perf_counter()
        trainer.train()
    steps = {}
    for entry in trainer.state.log_history:
        metrics = {k: v for k, v in entry.items() if k.startswith(("entropy_flow/", "opefo/"))}
        if metrics:
            steps.setdefault(entry["step"], {}).update(metrics)
    del trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return dict(
        learning_rate=learning_rate,
        bf16_autocast=bf16,
        weights_dtype=spec["dtype"],
        estimate=spec["entropy_flow_estimate"],
        seconds=time.perf_counter() - start,
        metrics={str(step): m for step, m in sorted(steps.items())},
    )


# ----------------------------------------------------------------------------------------------------------------------
# Driver and report
# ----------------------------------------------------------------------------------------------------------------------


def run(settings: PrecisionSettings, save=None, deadline: float | None = None) -> dict:
    """The whole measurement; `save(report)` is called after each part (the report so far), `deadline` (time.time())
    skips the OPEFOTrainer runs that would start after it."""
    save = save or (lambda report: None)
    work = settings.work_dir or tempfile.mkdtemp(prefix="opefo-precision-")
    path = os.path.join(work, "warm-model")
    start = time.perf_counter()
    report = dict(
        settings=asdict(settings),
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu, {torch.get_num_threads()} threads",
        float32_matmul_precision=torch.get_float32_matmul_precision(),
        cuda_matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32,
    )
    report["warm_start"] = warm_start(settings, path)
    save(report)
    t0 = time.perf_counter()
    rollout = sample_rollout(settings, path)
    reference = reference_statistics(settings, path, rollout)
    report["rollout"] = dict(
        completions=len(rollout.advantages),
        completion_length=rollout.completion_ids.shape[1],
        tokens=int(rollout.completion_mask.sum()),
        reward_mean=float(rollout.rewards.mean()),
        nonzero_advantages=int((rollout.advantages != 0).sum()),
        entropy=entropy_summary(reference, rollout),
        seconds=time.perf_counter() - t0,
    )
    save(report)
    report["modes"] = {}
    for mode in settings.modes:
        t0 = time.perf_counter()
        stats = mode_statistics(settings, path, rollout, mode)
        report["modes"][mode] = dict(
            **compare(reference, stats, rollout, settings), dtypes=stats["_dtypes"], seconds=time.perf_counter() - t0
        )
        save(report)
    if settings.trainer_runs:
        report["trainer_runs"] = {}
        for name in TRAINER_RUNS:
            if deadline is not None and time.time() > deadline:
                report["trainer_runs"][name] = {"skipped": "deadline"}
                continue
            try:
                report["trainer_runs"][name] = trainer_run(settings, path, name, work)
            except Exception as err:  # a failing run is a result; the others still run
                report["trainer_runs"][name] = {"error": f"{type(err).__name__}: {err}"}
            save(report)
    report["seconds"] = time.perf_counter() - start
    save(report)
    return report


def _fmt(x, spec=".3e"):
    return "n/a" if x is None else format(x, spec)


def markdown(report: dict) -> str:
    settings, rollout = report["settings"], report.get("rollout")
    lines = [
        f"Model: Qwen2 shape, hidden {settings['hidden_size']}, {settings['num_layers']} layers, vocabulary "
        f"{settings['vocab_size']}, warm-started {report['warm_start']['steps']} steps (loss "
        f"{report['warm_start']['first_loss']:.2f} -> {report['warm_start']['final_loss']:.2f}); {report['device']}, "
        f"float32 matmul precision {report['float32_matmul_precision']!r}, TF32 {report['cuda_matmul_allow_tf32']}.",
    ]
    if rollout:
        ent = rollout["entropy"]
        lines += [
            "",
            f"Rollout: {rollout['completions']} x {rollout['completion_length']} = {rollout['tokens']} tokens; token "
            f"entropy (float64) mean {ent['mean']:.2f}, p10/median/p90 {ent['p10']:.2f}/{ent['median']:.2f}/"
            f"{ent['p90']:.2f} nats, {ent['fraction_in_0p1_to_3']:.0%} in [0.1, 3].",
        ]
    for estimate in settings["estimates"]:
        if not report.get("modes"):
            break
        first = next(iter(report["modes"].values()))["estimates"][estimate]
        lines += [
            "",
            f"### `{estimate}` estimate vs float64 (lambda* reference {first['lambda_star_reference']:+.4e}, P "
            f"{first['increase_reference']:.4e}, N {first['decrease_reference']:.4e})",
            "",
            f"| mode | lambda* | abs error | > {LAMBDA_TOLERANCE:g} | P rel error | N rel error | sign agreement | "
            f"abs error per {first['block_tokens']}-token block (median / max) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for mode, row in report["modes"].items():
            r = row["estimates"][estimate]
            blocks = r["block_lambda_abs_errors"]
            lines.append(
                f"| {mode} | {r['lambda_star']:+.4e} | {r['lambda_abs_error']:.2e} | "
                f"{'yes' if r['lambda_error_above_tolerance'] else 'no'} | {r['increase_rel_error']:.2e} | "
                f"{r['decrease_rel_error']:.2e} | {r['sign_agreement']:.5f} | "
                f"{statistics.median(blocks):.2e} / {max(blocks):.2e} |"
            )
    if report.get("modes"):
        lines += [
            "",
            "Per-token statistics vs float64 (median abs error; H, log pi in nats):",
            "",
            "| mode | weights / head / vocab_stats dtype | log pi | H | sum pi^2 (median rel) | sum pi^2 log pi |",
            "|---|---|---|---|---|---|",
        ]
        for mode, row in report["modes"].items():
            t, d = row["per_token"], row["dtypes"]
            lines.append(
                f"| {mode} | {d['weights']} / {d['head']} / {d['vocab_stats_compute']} | "
                f"{t['logps']['median_abs_error']:.2e} | {t['entropies']['median_abs_error']:.2e} | "
                f"{t['sum_sq_probs']['median_rel_error']:.2e} | {t['sum_sq_probs_log_probs']['median_abs_error']:.2e} |"
            )
    for name, run_report in report.get("trainer_runs", {}).items():
        lines += ["", f"### OPEFOTrainer run `{name}`", ""]
        if "metrics" not in run_report:
            lines.append(f"not run: {run_report}")
            continue
        lines.append(
            f"estimate {run_report['estimate']}, learning rate {run_report['learning_rate']:g}, weights "
            f"{run_report['weights_dtype']}, bf16 autocast {run_report['bf16_autocast']}, audit every step, "
            f"{run_report['seconds']:.0f} s."
        )
        lines.append("")
        lines.append(metrics_table(run_report["metrics"]))
    return "\n".join(lines) + "\n"


def metrics_table(per_step: dict) -> str:
    """Every logged metric (rows) by step (columns), whatever metrics the trainer logs."""
    names = sorted({name for metrics in per_step.values() for name in metrics})
    steps = list(per_step)
    lines = ["| metric | " + " | ".join(f"step {s}" for s in steps) + " |", "|---|" + "---|" * len(steps)]
    for name in names:
        cells = [_fmt(per_step[s].get(name), "+.3e") for s in steps]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from opefo_trl.cli.options import INPUT_ERRORS, build_parser, parse_options, report_error

    parser = build_parser([PrecisionSettings], prog="precision.py", description=__doc__)
    try:
        (settings,) = parse_options(parser, argv)
    except INPUT_ERRORS as err:
        return report_error(parser.prog, err)
    os.makedirs(settings.output_dir, exist_ok=True)

    def save(report):
        with open(os.path.join(settings.output_dir, "precision.json"), "w") as f:
            json.dump(report, f, indent=2)

    report = run(settings, save)
    text = markdown(report)
    with open(os.path.join(settings.output_dir, "precision.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
