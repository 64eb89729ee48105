"""The tiny model and its supervised warm start, shared by every run of one numerics setting (cached on disk)."""

from __future__ import annotations

import json
import os
import time

from opefo_trl.data.prompts import render_prompts
from opefo_trl.demo.settings import DemoSettings
from opefo_trl.demo.tasks import TASKS
from opefo_trl.runs.files import write_json_atomically

WARM_START_MARKER = "demo_warm_start.json"
_WARM_START_KEYS = (
    "task", "hidden_size", "num_layers", "warm_start_steps", "warm_start_batch_size", "warm_start_learning_rate",
    "warm_start_seed",
)  # fmt: skip


def warm_start(output_dir: str, settings: DemoSettings, numerics: str, log=print) -> str:
    """Build the tiny model and fit it to the task's training targets for ``warm_start_steps`` supervised steps
    under the floating-point setting ``numerics`` (``NUMERICS``; set up by the caller); return its path.

    The loss is the completion tokens' cross-entropy (prompt tokens masked; the answer followed by the end-of-turn
    token, as TRL generates), AdamW with a short warm-up and a linear decay. A finished warm start with the same
    settings in ``output_dir/models/warm_start-<task>-<numerics>`` is reused.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opefo_trl.testing import build_tiny_model

    # DemoSettings.__post_init__ fills the settings left at None:
    assert settings.hidden_size is not None and settings.num_layers is not None
    assert settings.warm_start_steps is not None
    task = TASKS[settings.task]
    path = os.path.join(output_dir, "models", f"warm_start-{task.name}-{numerics}")
    marker = os.path.join(path, WARM_START_MARKER)
    key = {k: getattr(settings, k) for k in _WARM_START_KEYS} | {"numerics": numerics, "targets": task.train_targets}
    if _marked_settings(marker, log) == key:
        log(f"warm start: reusing {path}")
        return path

    base = build_tiny_model(
        os.path.join(output_dir, "models", f"base-{settings.hidden_size}x{settings.num_layers}"),
        hidden_size=settings.hidden_size,
        num_layers=settings.num_layers,
        seed=settings.warm_start_seed,
    )
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base)
    torch.manual_seed(settings.warm_start_seed)
    steps, batch_size = settings.warm_start_steps, settings.warm_start_batch_size
    examples = task.warm_start_answers(steps * batch_size, task.train_targets, settings.warm_start_seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.warm_start_learning_rate, weight_decay=0.0)
    warmup = max(1, steps // 15)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * max(0.0, 1.0 - s / max(1, steps))
    )
    log(f"warm start: {steps} supervised steps x {batch_size} examples, {task.name} task, numerics {numerics} ...")
    start, cpu_start, loss_value = time.perf_counter(), time.process_time(), float("nan")
    model.train()
    for step in range(steps):
        batch = examples[step * batch_size : (step + 1) * batch_size]
        prompts = render_prompts(tokenizer, [task.prompt(target) for target, _ in batch])
        answers = [
            tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for _, answer in batch
        ]
        length = max(len(p) + len(c) for p, c in zip(prompts, answers, strict=True))
        input_ids = torch.full((len(batch), length), tokenizer.pad_token_id)
        labels = torch.full((len(batch), length), -100)
        attention_mask = torch.zeros((len(batch), length), dtype=torch.long)
        for i, (p, c) in enumerate(zip(prompts, answers, strict=True)):
            input_ids[i, : len(p) + len(c)] = torch.tensor(p + c)
            attention_mask[i, : len(p) + len(c)] = 1
            labels[i, len(p) : len(p) + len(c)] = torch.tensor(c)
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()
        if (step + 1) % 100 == 0 or step + 1 == steps:
            log(f"  warm-start step {step + 1}/{steps}: loss {loss_value:.3f} ({time.perf_counter() - start:.0f} s)")
    model.eval()
    if os.path.lexists(marker):  # an earlier warm start's: it must not vouch for the weights saved now
        os.remove(marker)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    write_json_atomically(
        marker, {"settings": key, "final_loss": loss_value, "seconds": seconds, "cpu_seconds": cpu_seconds}
    )
    return path


def _marked_settings(marker: str, log) -> dict | None:
    """The settings a finished warm start's marker records; None (saying why, if it exists) if there are none to
    read: the warm start is then done again, over what its folder holds."""
    try:
        with open(marker) as f:
            marked = json.load(f)
        return marked["settings"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as err:
        log(f"warm start: its marker {marker} is not readable ({type(err).__name__}: {err}): warm-starting again")
        return None
