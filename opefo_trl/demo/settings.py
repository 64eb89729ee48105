"""The demo's methods and settings (``python -m opefo_trl.demo --help`` lists the settings)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from opefo_trl.demo.tasks import TASKS


@dataclass(frozen=True)
class DemoMethod:
    """A method of the comparison: a name for folders and tables, and the ``OPEFOConfig`` fields that make it."""

    name: str
    description: str
    config: dict

    @property
    def flow_estimate(self) -> str:
        """The entropy-flow estimate of the run, hence of its logged ``entropy_flow/lambda``."""
        return self.config.get("entropy_flow_estimate", "opefo")


#: The value of a method's config field that is the warm start's mean token entropy on the training prompts, measured
#: before the run (``training.build_config``): the level an entropy setpoint holds.
START_ENTROPY = "<warm start entropy>"

#: How the demo's report names a registered method (others: the method's own summary).
METHOD_DESCRIPTIONS = {
    "grpo": "strict on-policy GRPO",
    "opefo": "OPEFO, the paper's `opefo` estimate",
    "clip_cov": "Clip-Cov",
    "par": "PAR (entropy-guided positive-advantage reweighting)",
    "steer": "STEER (tokens weighted exp(-k |d_t|), floor 0.8, `opefo` flow)",
    "stare": "STARE (top-10% surprisal positive-advantage tokens x1.1 below entropy 0.3)",
}


def demo_methods(entropy_coef: float) -> dict[str, DemoMethod]:
    """The methods the demo can run: every registered token method at its defaults, and the configurations of the
    comparison that are not a method of their own (``entropy_coef`` is Entropy-Reg's bonus coefficient)."""
    from opefo_trl.methods import TOKEN_METHODS

    registered = [
        DemoMethod(name, METHOD_DESCRIPTIONS.get(name, f"{cls.__name__}: {cls.summary}"), {"method": name})
        for name, cls in TOKEN_METHODS.items()
    ]
    variants = [
        DemoMethod(
            "opefo_param_step",
            "OPEFO, `param`, whole AdamW step balanced (`opefo_balance='step'`)",
            {"method": "opefo", "entropy_flow_estimate": "param", "opefo_balance": "step"},
        ),
        DemoMethod(
            "entropy_reg",
            f"GRPO + entropy bonus (entropy_coef={entropy_coef:g})",
            {"method": "grpo", "entropy_coef": entropy_coef},
        ),
        DemoMethod(
            "opefo_param_step_task",
            "OPEFO, `param`, step balance of the entropy over the task's tokens (`entropy_flow_entropy='task_tokens'`)",
            {
                "method": "opefo",
                "entropy_flow_estimate": "param",
                "opefo_balance": "step",
                "entropy_flow_entropy": "task_tokens",
            },
        ),  # fmt: skip
        DemoMethod(
            "opefo_param_step_probe",
            "OPEFO, `param`, step balance of the last 4 rollouts' entropy (`entropy_flow_probe_rollouts=4`)",
            {
                "method": "opefo",
                "entropy_flow_estimate": "param",
                "opefo_balance": "step",
                "entropy_flow_probe_rollouts": 4,
            },
        ),  # fmt: skip
        DemoMethod(
            "opefo_param_step_setpoint",
            "OPEFO, `param`, step balance steering the entropy to the warm start's (`opefo_entropy_target`)",
            {
                "method": "opefo",
                "entropy_flow_estimate": "param",
                "opefo_balance": "step",
                "opefo_entropy_target": START_ENTROPY,
            },
        ),  # fmt: skip
        DemoMethod(
            "entropy_adaptive",
            "GRPO + TRL's adaptive entropy bonus, target the warm start's entropy (`use_adaptive_entropy`)",
            {"method": "grpo", "use_adaptive_entropy": True, "entropy_target": START_ENTROPY},
        ),
        DemoMethod(
            # STARE's default target (0.3 nats, for 7B models) lies far below the demo's entropy: its gate never opens.
            "stare_start",
            "STARE, target the warm start's entropy (the gate opens while entropy is below it)",
            {"method": "stare", "stare_target_entropy": START_ENTROPY},
        ),
        DemoMethod(
            "opefo_param",
            "OPEFO, `param`, the paper's per-batch balance",
            {"method": "opefo", "entropy_flow_estimate": "param"},
        ),
        DemoMethod(
            "opefo_full", "OPEFO, exact tabular estimate (`full`)", {"method": "opefo", "entropy_flow_estimate": "full"}
        ),
        DemoMethod(
            "opefo_centered",
            "OPEFO, the paper's estimate less its on-policy mean (`opefo_centered`)",
            {"method": "opefo", "entropy_flow_estimate": "opefo_centered"},
        ),
    ]
    return {m.name: m for m in (*registered, *variants)}


METHOD_NAMES = tuple(demo_methods(0.0))


@dataclass(frozen=True)
class Numerics:
    """A floating-point setting the demo can run under: torch's thread count and environment variables that the
    math libraries read when the process starts (a setting that needs other values runs in a process of its own)."""

    name: str
    description: str
    threads: int
    environment: dict[str, str] = field(default_factory=dict)


#: The settings ``--numerics`` chooses from. Two of them stand in for two machines only if they change the runs:
#: the report says when two settings gave identical logs.
NUMERICS = {
    n.name: n
    for n in (
        Numerics("threads1", "1 torch thread, the machine's default kernels", 1),
        Numerics(
            "threads2",
            "2 torch threads (changes the order of sums only for operations large enough to be split)",
            2,
        ),
        Numerics(
            "mkl_compatible",
            "1 torch thread, MKL_CBWR=COMPATIBLE: MKL's SSE2 kernels, rounding unlike the AVX2 / AVX-512 kernels MKL "
            "picks by default",
            1,
            {"MKL_CBWR": "COMPATIBLE"},
        ),
    )
}
#: Every variable some setting sets: a setting leaves the others unset.
NUMERICS_VARIABLES = tuple(sorted({k for n in NUMERICS.values() for k in n.environment}))
DEFAULT_METHODS = ("grpo", "opefo", "opefo_param_step", "entropy_reg")
#: The k of pass@k; the largest must not exceed the samples drawn per held-out target.
DEFAULT_PASS_AT_K = (1, 4, 16, 64)
#: The settings a task may set (``DemoTask.defaults``), where it does not.
COMMON_DEFAULTS = dict(
    warmup_steps=10, temperature=1.0, num_generations=8, pass_at_k_samples=64, pass_at_k=list(DEFAULT_PASS_AT_K)
)


def _setting(default, help: str, **kwargs):
    return field(default=default, metadata={"help": help}, **kwargs)


def _task_setting(help: str):
    return field(default=None, metadata={"help": f"{help} Default: the task's (see TASKS)."})


@dataclass
class DemoSettings:
    """Everything that determines the demo's results (saved to ``summary.json``); ``python -m opefo_trl.demo --help``
    lists them. Settings left at None take the task's value (``TASKS[task].defaults``).

    Example:
        >>> settings = DemoSettings(methods=["grpo", "opefo"], seeds=[0, 1], steps=30)
        >>> settings.hidden_size, settings.steps, settings.numerics, DemoSettings(quick=True).seeds
        (64, 30, ['threads1'], [0])
        >>> DemoSettings(quick=True).steps, DemoSettings().entropy_coef
        (20, 0.001)
    """

    output_dir: str = _setting("runs/demo", "Where models, runs, curves.png and summary.md go.")
    task: str = _setting(
        "digit_sum", f"Task: {', '.join(TASKS)} (word_problems: the pretrained SmolLM2-135M-Instruct, make demo-real)."
    )
    quick: bool = _setting(
        False,
        "CI mode: by default one seed, half the task's warm start and a third of its RL steps (values given "
        "explicitly are kept).",
    )
    methods: list[str] = field(
        default_factory=lambda: list(DEFAULT_METHODS),
        metadata={"help": f"Methods to compare, among {list(METHOD_NAMES)}."},
    )
    seeds: list[int] | None = field(
        default=None,
        metadata={"help": "RL seeds; every method runs with each of them. Default: 0 1 2 (0 with --quick)."},
    )
    numerics: list[str] = field(
        default_factory=lambda: ["threads1"],
        metadata={
            "help": "Floating-point settings, among "
            + "; ".join(f"{n.name}: {n.description}" for n in NUMERICS.values())
            + ". The whole demo (warm start included) runs once per setting, and the report says which readings hold "
            "in every setting: two settings that change only the rounding stand in for another machine."
        },
    )
    workers: int = _setting(
        2,
        "Runs of one setting trained side by side, each in a process of its own (2 for 2 cores: the runs are "
        "single-threaded under threads1 / mkl_compatible; a run's numbers do not depend on it).",
    )
    hidden_size: int | None = _task_setting("Hidden size of the tiny Qwen2 model.")
    num_layers: int | None = _task_setting("Layers of the tiny Qwen2 model.")
    warm_start_steps: int | None = _task_setting("Supervised warm-start steps (AdamW, linear decay).")
    warm_start_batch_size: int = _setting(64, "Examples per warm-start step.")
    warm_start_learning_rate: float = _setting(3e-3, "Peak learning rate of the warm start.")
    warm_start_seed: int = _setting(0, "Seed of the random model and of the warm-start data (shared by all runs).")
    steps: int | None = _task_setting("RL optimizer steps per run (each on a fresh rollout batch: strict on-policy).")
    prompts_per_step: int | None = _task_setting("Prompts per RL step.")
    num_generations: int | None = _task_setting("Sampled completions per prompt (GRPO group size).")
    micro_batch_size: int | None = _setting(
        None,
        "Completions per forward and backward (gradient accumulation over a step's rollout batch, still one "
        "optimizer step per rollout); it must divide prompts_per_step x num_generations. Default: the task's, else "
        "the whole rollout batch.",
    )
    max_completion_length: int | None = _task_setting("Completion token limit.")
    learning_rate: float | None = _task_setting("RL learning rate (constant after warm-up), the same for every method.")
    warmup_steps: int | None = _task_setting("RL learning-rate warm-up steps.")
    temperature: float | None = _task_setting("Sampling temperature of the rollouts and of the held-out samples.")
    entropy_coef: float = _setting(
        1e-3,
        "Entropy bonus coefficient of the `entropy_reg` method (TRL's entropy_coef); 1e-3 is the literature's "
        "default, fixed before the comparison.",
    )
    pass_at_k_samples: int | None = _task_setting(
        "Completions sampled per held-out target (at the rollouts' temperature) from the warm start or base model and "
        "from each trained policy, for pass@k and the distinct right answers (0 skips the evaluation)."
    )
    pass_at_k: list[int] | None = field(
        default=None,
        metadata={
            "help": "The k of the unbiased pass@k on the held-out targets (each <= pass_at_k_samples). Default: the "
            "task's (see TASKS)."
        },
    )

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"Unknown task {self.task!r}; choose one of {list(TASKS)}.")
        defaults = {**COMMON_DEFAULTS, **TASKS[self.task].defaults, "seeds": [0, 1, 2]}
        if self.quick:
            defaults.update(
                seeds=[0], warm_start_steps=defaults["warm_start_steps"] // 2, steps=max(2, defaults["steps"] // 3)
            )
        for name, value in defaults.items():
            if getattr(self, name) is None:
                setattr(self, name, list(value) if isinstance(value, list) else value)  # no list shared
        self.validate()

    def validate(self) -> None:
        """Raise ValueError for a setting that cannot work, before any model is built or trained."""
        unknown = [m for m in self.methods if m not in METHOD_NAMES]
        if unknown:
            raise ValueError(f"Unknown method(s) {unknown}; choose from {list(METHOD_NAMES)}.")
        unknown = [n for n in self.numerics if n not in NUMERICS]
        if unknown:
            raise ValueError(f"Unknown numerics setting(s) {unknown}; choose from {list(NUMERICS)}.")
        for name, example in (("methods", "grpo opefo"), ("seeds", "0 1 2"), ("numerics", "threads1 mkl_compatible")):
            values = getattr(self, name)
            if not values:
                raise ValueError(f"No {name} given; e.g. --{name} {example}.")
            if len(set(values)) != len(values):
                raise ValueError(f"--{name} has duplicates: {values}.")
        # __post_init__ fills the settings left at None:
        assert self.warm_start_steps is not None and self.prompts_per_step is not None
        assert self.num_generations is not None and self.pass_at_k_samples is not None and self.pass_at_k is not None
        assert self.temperature is not None
        task = TASKS[self.task]
        if task.pretrained_model is not None:
            fixed = {k: task.defaults[k] for k in ("hidden_size", "num_layers", "warm_start_steps")}
            changed = {k: getattr(self, k) for k, v in fixed.items() if getattr(self, k) != v}
            if changed:
                raise ValueError(
                    f"Task {self.task!r} trains the pretrained model as it is ({fixed}); it cannot take {changed}."
                )
        positive = (
            "steps", "warm_start_batch_size", "prompts_per_step", "max_completion_length", "hidden_size",
            "num_layers", "workers",
        )  # fmt: skip
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.warm_start_steps < 0 or self.pass_at_k_samples < 0:
            raise ValueError("warm_start_steps and pass_at_k_samples must be >= 0.")
        if self.pass_at_k_samples and (not self.pass_at_k or min(self.pass_at_k) < 1):
            raise ValueError(f"--pass_at_k needs whole numbers >= 1, got {self.pass_at_k}.")
        if self.pass_at_k_samples and max(self.pass_at_k) > self.pass_at_k_samples:
            raise ValueError(
                f"pass@{max(self.pass_at_k)} needs at least {max(self.pass_at_k)} samples per target, but "
                f"pass_at_k_samples={self.pass_at_k_samples}: raise pass_at_k_samples or drop that k."
            )
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{f.name} must be a finite number, got {value}.")
        for name in ("learning_rate", "warm_start_learning_rate", "temperature"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}.")
        if self.entropy_coef < 0:
            raise ValueError(f"entropy_coef must be >= 0, got {self.entropy_coef}.")
        if self.num_generations < 2:
            raise ValueError(
                f"num_generations must be >= 2 (GRPO needs a group to compare), got {self.num_generations}."
            )
        completions = self.prompts_per_step * self.num_generations
        if self.micro_batch_size is not None and (self.micro_batch_size < 1 or completions % self.micro_batch_size):
            raise ValueError(
                f"micro_batch_size ({self.micro_batch_size}) must divide the {completions} completions of a step "
                "(prompts_per_step x num_generations)."
            )
        targets = len(task.train_targets)
        if self.prompts_per_step > targets:
            raise ValueError(
                f"prompts_per_step ({self.prompts_per_step}) exceeds the {targets} training prompts of task "
                f"{self.task!r}: TRL draws distinct prompts within a step."
            )
