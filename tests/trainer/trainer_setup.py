"""What the trainer tests share: a tiny CPU configuration, building a trainer, reading its logs, spying on a part."""

from opefo_trl import OPEFOConfig, OPEFOTrainer


def base_settings(tmp_path, **overrides):
    settings = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=12,
        max_steps=2,
        logging_steps=1,
        learning_rate=1e-3,
        bf16=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    settings.update(overrides)
    return settings


def make_config(tmp_path, **overrides):
    return OPEFOConfig(**base_settings(tmp_path, **overrides))


def logged(trainer, name):
    return [entry[name] for entry in trainer.state.log_history if name in entry]


def make_trainer(tiny_model_path, tiny_dataset, length_reward, args, trainer_class=OPEFOTrainer, **kwargs):
    return trainer_class(
        model=tiny_model_path, reward_funcs=length_reward, args=args, train_dataset=tiny_dataset, **kwargs
    )


def spy(owner, name, record):
    """Replace ``owner.name`` (a part's method) by ``record(original, *args)``, which calls the original."""
    original = getattr(owner, name)
    setattr(owner, name, lambda *args, **kwargs: record(original, *args, **kwargs))


def float64_reference(model_path, batch, temperature, direction=None, step=0.0):
    """An independent float64 scoring of a TRL micro-batch's completions: a plain float64 copy of the model loaded
    from ``model_path`` (no TRL head, hook or patch), logits / ``temperature``, a full float64 softmax. Returns log
    pi_t, H_t and the surprise-gap moments S_2, S_3 = sum_k pi_k^2 (log pi_k + H_t), sum_k pi_k^3 (...), (B, T)
    each; with ``direction`` ({parameter name: tensor}), those of the parameters moved by ``step * direction``."""
    import torch
    from transformers import AutoModelForCausalLM

    from opefo_trl.testing import keep_rms_norm_in_model_dtype

    # Qwen2's RMSNorm computes in float32 whatever the model's dtype: kept in float64 here.
    model = keep_rms_norm_in_model_dtype(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)).eval()
    if direction is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in direction:
                    p.add_(direction[name].to(torch.float64), alpha=step)
    completion = batch["completion_ids"]
    length = completion.size(1)
    ids = torch.cat([batch["prompt_ids"], completion], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits[:, -length - 1 : -1]
    logp = torch.log_softmax(logits / temperature, -1)
    probs = logp.exp()
    entropy = -(probs * logp).sum(-1)
    gap = logp + entropy[..., None]
    return (
        logp.gather(-1, completion[..., None])[..., 0],
        entropy,
        (probs**2 * gap).sum(-1),
        (probs**3 * gap).sum(-1),
    )


def first_rollout(trainer):
    """TRL's first rollout batch, generated, shuffled and split into micro-batches (`GRPOTrainer._prepare_inputs`),
    then weighed as `OPEFOTrainer` weighs it at the loss of its first micro-batch; returns that micro-batch."""
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    if getattr(trainer, "rollout", None) is not None:
        trainer.rollout.prepare(trainer._buffered_inputs, inputs)
    return inputs


# --- The vLLM tier (TRL's colocate generation on vLLM's CPU build).


def lambda_from_scoring(trainer, batches) -> float:
    """lambda* of a rollout's micro-batches from the trainer's own scoring pass (``Scorer.score``) at the current
    parameters."""
    from opefo_trl.maths.entropy_flow import flow_per_unit_advantage, flow_stats

    totals = None
    estimate = trainer.args.entropy_flow_estimate
    for batch in batches:
        scores = trainer.scorer.score(batch, vocab=estimate == "full")
        advantages = batch["advantages"].float()
        factor = trainer.loss_mirror.factor(batch, scores.logps, scores.entropies, advantages)
        unit = flow_per_unit_advantage(scores.logps, scores.entropies, estimate, *scores.moments)
        stats = flow_stats(advantages.unsqueeze(1) * unit, factor)
        totals = stats if totals is None else totals + stats
    return float(totals.lambda_star)


def vllm_weights(trainer):
    """The colocated engine's parameters by vLLM's names (float32 copies)."""
    model = trainer.vllm_generation.llm.llm_engine.model_executor.driver_worker.model_runner.model
    return {name: param.detach().float().clone() for name, param in model.named_parameters()}


def release_vllm(trainer):
    """Free the colocated engine, so that the next test's can start in this process."""
    import gc

    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    del trainer.vllm_generation.llm
    destroy_model_parallel()
    destroy_distributed_environment()
    gc.collect()
