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
