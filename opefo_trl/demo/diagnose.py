"""Why a demo run diverges: re-run it with the exact parameter-space flow evaluated on every rollout batch.

``python -m opefo_trl.demo.diagnose`` takes the demo's options (one method with a tabular estimate, e.g. ``opefo``;
one or more ``--seeds``; one ``--numerics``) and the demo's ``--output_dir``, whose cached warm start it reuses. Each
run is repeated with the same code path (``train_one``) by a trainer that, before every update, also computes the
``param`` estimate's per-token flow d_t = A_t <D grad Hbar, grad log pi_t> on the same batch (the trainer's own
``param`` estimator: Adam-preconditioned, forward-mode, checked against the backward-mode derivative and net flow).
That extra work draws no random numbers and restores the parameters bit for bit, so the run must reproduce the
demo's logged trajectory; ``reproduced`` in the output says whether it did (compared with
``runs/<numerics>/<method>-seed<k>``).

Per step it records (``OUTPUT_DIR/diagnose/<numerics>/<method>-seed<k>/diagnostics.json``, figure ``diagnose.png``):

- lambda* of the tabular estimate (what OPEFO balances) and of the parameter-space flow of the same batch;
- the parameter-space net flow of the update the run really applies (OPEFO's weights), as a fraction of the gross,
  beside that of the unweighted (GRPO) update: 0 would mean OPEFO's balance holds in the real network;
- the share of tokens, and of the parameter-space gross flow, on which the two estimates disagree in sign;
- the first-order prediction of the step's entropy change (this batch's part and what Adam's momentum carries),
  next to the measured change the run logs;
- per token class (digit, end of answer, any other token): share of tokens, probability, weight, and flows.

Example:
    >>> token_classes(["7", " 3", "<|im_end|>", "x", "abc"], end_token="<|im_end|>")
    ['digit', 'digit', 'end', 'other', 'other']
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opefo_trl._extras import needs_extra, require_extra
from opefo_trl.demo.runner import ENVIRONMENT, needs_own_process, run_dir
from opefo_trl.demo.settings import NUMERICS, NUMERICS_VARIABLES, DemoMethod, DemoSettings, demo_methods
from opefo_trl.demo.training import FINGERPRINT_METRICS, train_one
from opefo_trl.demo.warm_start import warm_start

if TYPE_CHECKING:
    from opefo_trl.trainer import OPEFOTrainer

TOKEN_CLASSES = ("digit", "end", "other")
STEPS_FILE = "diagnostic_steps.json"
_DIGIT_TOKEN = re.compile(r"\s*\d")


def token_classes(tokens: Sequence[str], end_token: str) -> list[str]:
    """The class of each token text: 'digit' (a digit, optionally after spaces), 'end' (``end_token``), 'other'."""
    return ["end" if text == end_token else "digit" if _DIGIT_TOKEN.fullmatch(text) else "other" for text in tokens]


def diagnostic_trainer_class() -> type[OPEFOTrainer]:
    """``OPEFOTrainer`` with the parameter-space reference on every rollout batch: one record per step, written to
    ``<output_dir>/STEPS_FILE`` when training ends."""
    import torch
    from transformers import TrainerCallback

    from opefo_trl import OPEFOTrainer
    from opefo_trl.experimental.extension_parts import build_param_estimate
    from opefo_trl.experimental.optimizer import adam_preconditioner, inner, param_groups
    from opefo_trl.experimental.step_model import first_order_change
    from opefo_trl.maths.entropy_flow import flow_per_unit_advantage, flow_stats, lambda_star, token_weights
    from opefo_trl.trainer.batch_state import RolloutItem
    from opefo_trl.trainer.parts import TrainerAccess
    from opefo_trl.trainer.token_weights import carried_scores, per_token

    class DiagnosticTrainer(OPEFOTrainer):
        records: list[dict]

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # the parameter-space flow, whatever the run's own estimate
            self.reference = build_param_estimate(self, TrainerAccess(self), self.scorer, self.loss_mirror)
            self.add_callback(BeforeOptimizerStep(self))

        def train(self, *args, **kwargs):
            output = super().train(*args, **kwargs)
            with open(os.path.join(self.args.output_dir, STEPS_FILE), "w") as f:
                json.dump(self.records, f)
            return output

        def _generate_and_score_completions(self, inputs):
            # The whole rollout batch, before TRL splits it into micro-batches and before any method reweights it.
            output = super()._generate_and_score_completions(inputs)
            if self.model.training:
                self._record_reference(output)
            return output

        @torch.no_grad()
        def _record_reference(self, batch: dict) -> None:
            if not hasattr(self, "records"):
                tokenizer = self.processing_class
                texts = [tokenizer.decode([i]) for i in range(len(tokenizer))]
                classes = token_classes(texts, tokenizer.eos_token)
                self._token_class = torch.tensor([TOKEN_CLASSES.index(c) for c in classes])
                self.records = []
            # A copy: the run's own micro-batches must stay as TRL built them. TRL's old-log-prob pass, where the
            # run captured it, gives log pi and H, as in the run's own rollout pass.
            captured = carried_scores(batch)
            advantages_per_token = per_token(batch["advantages"], batch["completion_mask"]).float()
            item = RolloutItem(dict(batch), advantages_per_token, captured)
            _, flow = self.reference.estimate([item])
            alignment = torch.cat([u.flatten() for u in flow.alignment])
            self._reference_entropy_grad = flow.entropy_grad  # grad Hbar, for the step's first-order change

            assert item.scores is not None and item.factor is not None  # filled in by the estimate
            logps, entropies = item.scores.logps.flatten().double(), item.scores.entropies.flatten().double()
            factor, advantages = item.factor.flatten().double(), item.advantages.flatten().double()
            ids = batch["completion_ids"].flatten()
            tabular = advantages * flow_per_unit_advantage(logps, entropies, "opefo").double()
            exact = advantages * alignment.double()
            weights = torch.ones_like(tabular)
            if self.args.method == "opefo":
                stats = flow_stats(tabular, factor)
                lam = self.args.opefo_lambda
                lam = lambda_star(stats.increase, stats.decrease).clamp(-1, 1) if lam is None else lam
                weights = token_weights(tabular, lam, self.args.opefo_sides).double()
            in_loss = factor > 0
            gross = float((factor * exact.abs()).sum())
            disagree = in_loss & (tabular * exact < 0)
            record: dict[str, Any] = {
                "lambda_tabular": float(flow_stats(tabular, factor).lambda_star),
                "lambda_param": float(flow_stats(exact, factor).lambda_star),
                "param_net_unweighted": float((factor * exact).sum()),
                "param_net_applied": float((factor * weights * exact).sum()),
                "param_gross": gross,
                "tabular_net_applied": float((factor * weights * tabular).sum()),
                "sign_disagreement_tokens": float(disagree.sum() / in_loss.sum().clamp(min=1)),
                "sign_disagreement_flow": float((factor * exact.abs())[disagree].sum()) / gross if gross else 0.0,
                "classes": {},
            }
            token_class = self._token_class[ids]
            for k, name in enumerate(TOKEN_CLASSES):
                chosen = in_loss & (token_class == k)
                f = factor[chosen]
                record["classes"][name] = {
                    "token_share": float(chosen.sum() / in_loss.sum().clamp(min=1)),
                    "mean_prob": float(logps[chosen].exp().mean()) if chosen.any() else None,
                    "mean_advantage": float(advantages[chosen].mean()) if chosen.any() else None,
                    "mean_weight": float(weights[chosen].mean()) if chosen.any() else None,
                    "tabular_increase": float((f * tabular[chosen]).clamp(min=0).sum()),
                    "tabular_decrease": float(-(f * tabular[chosen]).clamp(max=0).sum()),
                    "param_increase": float((f * exact[chosen]).clamp(min=0).sum()),
                    "param_decrease": float(-(f * exact[chosen]).clamp(max=0).sum()),
                    "param_net_applied": float((f * weights[chosen] * exact[chosen]).sum()),
                }
            self.records.append(record)

    class BeforeOptimizerStep(TrainerCallback):
        def __init__(self, trainer: DiagnosticTrainer):
            self.trainer = trainer

        @torch.no_grad()
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            # The real (clipped) gradient is in p.grad: the first-order change of Hbar this AdamW step makes, and the
            # part of it Adam's momentum carries: update = -lr (c1 g + c2 m_prev) D, D = 1 / (sqrt(v_hat) + eps)
            # with this g in v_hat, so the momentum's part is -lr c2 m_prev D.
            trainer = self.trainer
            optimizer, params = trainer.access.torch_optimizer(), trainer.access.trainable_parameters()
            entropy_grad, record = trainer._reference_entropy_grad, trainer.records[-1]
            record["predicted"] = first_order_change(optimizer, params, entropy_grad, (p.grad for p in params))
            groups, momentum = param_groups(optimizer), 0.0
            for p, h in zip(params, entropy_grad, strict=True):
                opt_state, group = optimizer.state.get(p), groups[id(p)]
                if p.grad is None or not opt_state:
                    continue
                beta1, step = group["betas"][0], float(opt_state["step"]) + 1
                d = adam_preconditioner(optimizer, group, p, p.grad)
                assert d is not None  # an Adam group
                update = opt_state["exp_avg"].to(d.dtype).mul(d).mul_(-group["lr"] * beta1 / (1 - beta1**step))
                momentum += inner([h], [update])
            record["predicted_momentum"] = momentum
            record["predicted_batch"] = record["predicted"] - momentum  # with weight decay 0, the gradient's part
            trainer._reference_entropy_grad = None

    return DiagnosticTrainer


@dataclass
class Diagnosis:
    """One diagnosed run: where it was written, and whether it reproduced the demo's run (None: nothing to compare)."""

    path: str
    reproduced: bool | None
    max_difference: float | None


def compare_histories(history: list[dict], reference: list[dict]) -> float:
    """Largest absolute difference, over the steps and ``FINGERPRINT_METRICS``, between two runs' logged rows
    (inf when the steps or metrics differ)."""

    def rows(h):
        return {r["step"]: r for r in h if "entropy" in r}

    ours, theirs = rows(history), rows(reference)
    if ours.keys() != theirs.keys():
        return math.inf
    worst = 0.0
    for step, row in ours.items():
        for key in FINGERPRINT_METRICS:
            a, b = row.get(key), theirs[step].get(key)
            if (a is None) != (b is None):
                return math.inf
            if a is not None and not (a == b or (math.isnan(a) and math.isnan(b))):
                worst = max(worst, abs(a - b) if math.isfinite(a - b) else math.inf)
    return worst


def check_diagnosable(settings: DemoSettings) -> DemoMethod:
    """The one method to diagnose; ValueError unless there is one, with a tabular estimate, and one numerics setting."""
    if len(settings.methods) != 1 or len(settings.numerics) != 1:
        raise ValueError("give one method (--methods opefo) and one numerics setting (--numerics threads1).")
    numerics = NUMERICS[settings.numerics[0]]
    if needs_own_process(numerics):
        wanted = " ".join(f"{k}={v}" for k, v in numerics.environment.items())
        how = f"start it as `{wanted} python -m opefo_trl.demo.diagnose ...`" if wanted else "unset them"
        raise ValueError(
            f"numerics {numerics.name} needs other values of {list(NUMERICS_VARIABLES)} than this process was started "
            f"with: {how}."
        )
    method = demo_methods(settings.entropy_coef)[settings.methods[0]]
    if method.flow_estimate == "param":
        raise ValueError(
            f"{method.name} already runs on the `param` estimate (its log has the parameter-space flow); diagnose a "
            "method with a tabular estimate, e.g. --methods opefo."
        )
    return method


def diagnose(settings: DemoSettings, log=print) -> list[Diagnosis]:
    """Diagnose ``settings.methods[0]`` for each of ``settings.seeds`` under ``settings.numerics[0]``."""
    import torch

    method = check_diagnosable(settings)
    assert settings.seeds is not None  # DemoSettings.__post_init__ fills the settings left at None
    numerics = settings.numerics[0]
    previous = torch.get_num_threads()
    torch.set_num_threads(NUMERICS[numerics].threads)
    try:
        model_path = warm_start(settings.output_dir, settings, numerics, log=log)
        found = []
        for seed in settings.seeds:
            path = os.path.join(settings.output_dir, "diagnose", numerics, f"{method.name}-seed{seed}")
            log(f"diagnosing {method.name} seed {seed}, numerics {numerics} -> {path}")
            trainer_class = diagnostic_trainer_class()
            train_one(method, seed, numerics, model_path, path, settings, log=log, trainer_class=trainer_class)
            with open(os.path.join(path, "trainer_state.json")) as f:
                history = json.load(f)["log_history"]
            with open(os.path.join(path, STEPS_FILE)) as f:
                records = json.load(f)
            reference = run_dir(settings.output_dir, numerics, method.name, seed)
            reference_state = os.path.join(reference, "trainer_state.json")
            reproduced = difference = None
            if os.path.exists(reference_state):
                with open(reference_state) as f:
                    difference = compare_histories(history, json.load(f)["log_history"])
                reproduced = difference == 0.0
                log(f"  reproduces {reference_state}: {reproduced} (largest difference {difference:.3g})")
            with open(os.path.join(path, "diagnostics.json"), "w") as f:
                json.dump({"reproduced": reproduced, "max_difference": difference, "steps": records}, f)
            plot_diagnosis(history, records, os.path.join(path, "diagnose.png"), f"{method.name} seed {seed}")
            found.append(Diagnosis(path, reproduced, difference))
        return found
    finally:
        torch.set_num_threads(previous)


def class_share(records: list[dict], name: str, flow: str) -> list[float]:
    """Per step, the share of the batch's ``flow`` (e.g. ``tabular_decrease``) that tokens of class ``name`` carry."""
    shares = []
    for r in records:
        total = sum(c[flow] for c in r["classes"].values())
        shares.append(r["classes"][name][flow] / total if total else 0.0)
    return shares


def plot_diagnosis(history: list[dict], records: list[dict], path: str, title: str) -> str:
    """Six panels over the steps: lambda* of both estimates; measured vs predicted entropy change (batch part,
    momentum part); the real network's net / gross flow of the applied vs the unweighted update; sign disagreement;
    the non-digit tokens' share of the decrease flow N by each estimate; entropy, reward and gradient norm."""
    import numpy as np

    with needs_extra("plot", "matplotlib", "plot_diagnosis"):
        from matplotlib.figure import Figure

    rows = [r for r in history if "entropy" in r]
    steps = np.arange(1, len(records) + 1)

    def series(key, source=records):
        return np.array([r.get(key, np.nan) for r in source], dtype=float)

    fig = Figure(figsize=(13, 10))
    axes = fig.subplots(3, 2).flat
    ax = next(axes)
    ax.plot(steps, series("lambda_tabular"), label="λ* of the `opefo` estimate (what OPEFO balances)")
    ax.plot(steps, series("lambda_param"), label="λ* of the parameter-space flow, same batch")
    ax.set_title("balance coefficient")
    ax = next(axes)
    measured = series("entropy_flow/measured_delta", rows)[: len(steps)]
    ax.plot(steps[: len(measured)], measured, color="k", label="measured")
    ax.plot(steps, series("predicted"), label="predicted, first order (param)")
    ax.plot(steps, series("predicted_batch"), ls="--", label="… of which this batch")
    ax.plot(steps, series("predicted_momentum"), ls=":", label="… of which Adam's momentum")
    ax.set_title("entropy change of each update")
    ax = next(axes)
    gross = series("param_gross")
    ax.plot(steps, series("param_net_applied") / gross, label="applied (OPEFO-weighted) update")
    ax.plot(steps, series("param_net_unweighted") / gross, label="unweighted (GRPO) update")
    ax.set_title("parameter-space net / gross flow of the batch")
    ax = next(axes)
    ax.plot(steps, series("sign_disagreement_tokens"), label="share of tokens")
    ax.plot(steps, series("sign_disagreement_flow"), label="share of the parameter-space gross flow")
    ax.set_title("`opefo` vs parameter-space flow: opposite sign")
    ax = next(axes)
    for name in TOKEN_CLASSES[1:]:  # digits carry the rest
        (line,) = ax.plot(steps, class_share(records, name, "tabular_decrease"), label=f"{name}: share of `opefo` N")
        color = line.get_color()
        ax.plot(steps, class_share(records, name, "param_decrease"), color=color, ls="--", label="… of param N")
        ax.plot(steps, [r["classes"][name]["token_share"] for r in records], color=color, ls=":", label="… of tokens")
    ax.set_title("non-digit tokens: share of the decrease flow N")
    ax = next(axes)
    ax.plot(steps[: len(rows)], series("entropy", rows)[: len(steps)], label="entropy (nats)")
    ax.plot(steps[: len(rows)], series("reward", rows)[: len(steps)], label="reward")
    ax.plot(steps[: len(rows)], series("grad_norm", rows)[: len(steps)], label="gradient norm")
    ax.set_title("entropy, reward, gradient norm")
    for ax in fig.axes:
        ax.axhline(0.0, color="0.6", lw=0.8, zorder=0)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{title}: the `opefo` estimate's balance against the exact parameter-space flow")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv: list[str] | None = None) -> int:
    for name, value in ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    from opefo_trl.cli.options import INPUT_ERRORS, build_parser, parse_options, report_error

    parser = build_parser(
        [DemoSettings],
        prog="python -m opefo_trl.demo.diagnose",
        description="Re-run demo runs (one method with a tabular estimate, one numerics setting, the given seeds) with "
        "the exact parameter-space entropy flow evaluated on every rollout batch as a reference.",
    )
    try:
        (settings,) = parse_options(parser, argv)
        require_extra("plot", "matplotlib", "python -m opefo_trl.demo.diagnose (its figure)")
        check_diagnosable(settings)
    except INPUT_ERRORS as err:
        return report_error(parser.prog, err)
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    for found in diagnose(settings, log=lambda msg: print(msg, flush=True)):
        print(f"{found.path}: diagnostics.json, diagnose.png; reproduced the demo's run: {found.reproduced}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
