"""GRPO vs OPEFO (and baselines) side by side on a laptop CPU: entropy collapse, entropy-flow balance, what the
updates really did to entropy, and pass@k on held-out prompts.

Runs offline, with nothing downloaded. For each floating-point setting (``--numerics``, ``settings.NUMERICS``: two
settings that change only the rounding stand in for another machine; one that needs environment variables read at
start-up, such as ``MKL_CBWR``, runs in a process of its own):

1. builds a tiny Qwen2-shaped model with the arithmetic tokenizer of ``opefo_trl.testing`` and warm-starts it with
   supervised steps on the task's training targets, so that the RL start policy is partly right and spreads its
   probability over many right answers (cached in ``OUTPUT_DIR/models/warm_start-<task>-<numerics>``);
2. trains each method for each seed from those weights with ``OPEFOTrainer`` (TRL's GRPO code path), identical
   budgets, auditing every step (``entropy_flow_audit_steps=1``: the batch is re-scored after the update and the
   measured change of its mean token entropy logged), writing ``OUTPUT_DIR/runs/<numerics>/<method>-seed<k>/``;
3. samples the warm start and each trained policy 64 times per held-out target and reports unbiased pass@k;

then writes ``OUTPUT_DIR/curves.png`` (entropy, reward, lambda*, flows, measured vs predicted entropy change,
pass@k against k; mean +- std over seeds), ``summary.md`` (tables per numerics setting, failed runs, the
pre-registered readings and whether each holds in every setting, and whether two settings gave identical runs:
``opefo_trl.demo.report``) and ``summary.json``. One demo writes into ``OUTPUT_DIR`` at a time: it holds the folder's
lock, as ``opefo-train`` does, and a second is refused.

Tasks (``--task``, ``opefo_trl.demo.tasks``; every fifth target is held out of training for pass@k):

- ``digit_sum`` (default; ``opefo_trl.demo.digit_sum``): "Write 24 digits that add up to t", graded by how close
  the digit sum is. No single token decides the reward, so a GRPO batch's entropy flow nearly cancels (|lambda*| a
  few hundredths: the paper's regime, within what a CPU batch allows) while GRPO's entropy still falls.
- ``sum`` (``opefo_trl.demo.addition``): "Solve t = ? + ?". The decisive second addend dominates the flow, lambda*
  is ~0.7: far outside the paper's regime (kept as the documented out-of-regime case; the regime guard fires there).

Usage:
    python -m opefo_trl.demo --output_dir runs/demo                     # digit_sum: 4 methods x 3 seeds, 1 thread
    python -m opefo_trl.demo --output_dir runs/demo-full --seeds 0 1 2 3 4 --numerics threads1 mkl_compatible
    python -m opefo_trl.demo --output_dir runs/demo-quick --quick true  # 1 seed, fewer steps (CI)
    python -m opefo_trl.demo --output_dir runs/demo-sum --task sum      # the out-of-regime task
    python -m opefo_trl.demo --output_dir runs/x --methods grpo opefo_param clip_cov par --seeds 0 1 2 3 4

Methods: ``grpo`` (strict on-policy GRPO), ``opefo`` (the paper's estimate), ``opefo_param_step`` (the exact
parameter-space flow, balancing the whole AdamW step), ``entropy_reg`` (GRPO + TRL's ``entropy_coef``, 1e-3), and
behind ``--methods``: ``opefo_param`` (``param`` with the paper's per-batch balance), ``opefo_full``, ``clip_cov``,
``par``. Every run logs the entropy-flow diagnostics (the lambda* OPEFO would use), so the lambda* panel is
meaningful for the baselines too. ``python -m opefo_trl.demo.diagnose`` re-runs one run with the parameter-space
flow evaluated on its batches as a reference (``opefo_trl.demo.diagnose``).
"""

from opefo_trl.demo.evaluate import HeldOutResult, evaluate_held_out
from opefo_trl.demo.report import failure_reason, summary_markdown
from opefo_trl.demo.runner import main, run_demo
from opefo_trl.demo.settings import METHOD_NAMES, DemoMethod, DemoSettings, demo_methods
from opefo_trl.demo.tasks import TASKS, DemoTask
from opefo_trl.demo.training import REQUIRED_METRICS, RunResult, summarize_history, train_one
from opefo_trl.demo.warm_start import warm_start

__all__ = [
    "METHOD_NAMES",
    "REQUIRED_METRICS",
    "TASKS",
    "DemoMethod",
    "DemoSettings",
    "DemoTask",
    "HeldOutResult",
    "RunResult",
    "demo_methods",
    "evaluate_held_out",
    "failure_reason",
    "main",
    "run_demo",
    "summarize_history",
    "summary_markdown",
    "train_one",
    "warm_start",
]
