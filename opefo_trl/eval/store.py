"""The resumable sample store (``samples.jsonl`` + ``run_config.json``) and the samples a run still has to draw.

Every sample has its own seed, a hash of ``(seed, benchmark, problem_id, sample_index)``: what a run draws for a
sample does not depend on how many samples of its problem were stored before an interruption, nor on what else is
generated with it (see :mod:`opefo_trl.eval` for what that does and does not make reproducible).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from opefo_trl.runs.files import (
    RUN_CONFIG_FILE,
    SAMPLES_FILE,
    read_json_lines,
    write_json_atomically,
    write_text_atomically,
)

from .benchmarks import Problem, ResolvedBenchmark

logger = logging.getLogger(__name__)

#: Settings key of the hashes of the weight files (`ModelSource.weight_fingerprints`) the samples were drawn from.
#: A store without it (or with fingerprints of another kind under another key) is refused as unrecorded.
WEIGHTS_KEY = "weight_file_hashes"
#: Settings key of the fingerprints of the tokenizer, chat template, config and generation config
#: (`ModelSource.file_fingerprints`) the samples were drawn with.
MODEL_FILES_KEY = "model_files"
#: How a change of each is described: what, the files it covers, a likely cause.
_CHANGES = {
    WEIGHTS_KEY: ("weights", "weights", "training wrote into {model}"),
    MODEL_FILES_KEY: (
        "model files",
        "model files (tokenizer, chat template, config, generation config)",
        "the chat template or generation config of {model} was edited",
    ),
}
#: The fields of a stored sample that resuming and scoring read.
RECORD_FIELDS = ("benchmark", "problem_id", "sample_index", "fingerprint", "completion", "num_tokens", "finish_reason")


def sample_seed(seed: int, benchmark: str, problem_id: int, sample_index: int) -> int:
    """The seed of one sample: a function of these four values only (a 63-bit hash, valid for torch and vLLM).

    >>> sample_seed(0, "aime24", 3, 5) == sample_seed(0, "aime24", 3, 5) != sample_seed(0, "aime24", 3, 6)
    True
    """
    digest = hashlib.sha256(f"{seed}/{benchmark}/{problem_id}/{sample_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@dataclass(frozen=True)
class SampleJob:
    """One sample to draw: which one, the prompt's token ids and the sample's own seed (:func:`sample_seed`)."""

    benchmark: str
    problem_id: int
    sample_index: int
    fingerprint: str
    prompt_ids: tuple[int, ...]
    seed: int


class StoreWriteError(Exception):
    """A file of an evaluation's output_dir that cannot be written (a full disk); the message says what is full and
    what was kept."""


class SampleStore:
    """Append-only JSONL of samples keyed by (benchmark, problem_id, sample_index), plus the run settings.

    Example:
        >>> store = SampleStore("runs/eval")                     # doctest: +SKIP
        >>> store.check_settings({"temperature": 1.0, ...})      # doctest: +SKIP
    """

    def __init__(self, output_dir: str, overwrite: bool = False):
        self.output_dir = output_dir
        self.samples_path = os.path.join(output_dir, SAMPLES_FILE)
        self.settings_path = os.path.join(output_dir, RUN_CONFIG_FILE)
        os.makedirs(output_dir, exist_ok=True)
        if overwrite:
            for path in (self.samples_path, self.settings_path):
                if os.path.exists(path):
                    os.remove(path)
        self.samples: dict[tuple[str, int, int], dict] = {}
        if os.path.exists(self.samples_path):
            self._read()

    def _read(self) -> None:
        def refuse(number: int, line: str) -> ValueError:
            return ValueError(f"{self.samples_path}, line {number}, is not valid JSON; fix or remove the file.")

        rows, cut_off = read_json_lines(self.samples_path, refuse)
        for number, line, record in rows:
            missing = [k for k in RECORD_FIELDS if k not in record] if isinstance(record, dict) else RECORD_FIELDS
            if missing:
                raise ValueError(
                    f"{self.samples_path}, line {number}, is not a stored sample (no {', '.join(missing)}): "
                    f"{line.strip()[:120]}. Fix or remove that line, or discard every stored sample with "
                    "overwrite=True (--overwrite true)."
                )
            self.samples[(record["benchmark"], record["problem_id"], record["sample_index"])] = record
        if cut_off:  # a run killed mid-write leaves a partial last line: drop it
            logger.warning("Dropping a truncated last line of %s (interrupted write).", self.samples_path)
            write_text_atomically(
                self.samples_path, "".join(line if line.endswith("\n") else line + "\n" for _, line, _ in rows)
            )
        elif rows and not rows[-1][1].endswith("\n"):  # whole, but the next append would be glued on
            with open(self.samples_path, "a") as f:
                f.write("\n")
            logger.warning("Added the newline missing at the end of %s (interrupted write).", self.samples_path)

    def _stored_settings(self) -> dict[str, Any] | None:
        """The settings in ``run_config.json`` (None without one); refused if the file is cut off or not a mapping,
        and missing while samples are stored (nothing then says which model and settings drew them)."""
        if not os.path.exists(self.settings_path):
            if self.samples:
                raise ValueError(
                    f"{self.samples_path} holds {len(self.samples)} samples, but {self.settings_path} (the model, "
                    "weights and settings they were drawn with) is missing: they cannot be told from another "
                    "model's. Use another output_dir, or overwrite=True (--overwrite true) to discard them."
                )
            return None
        try:
            with open(self.settings_path) as f:
                stored = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            stored, problem = None, f"is not valid JSON ({err}; cut off?)"
        else:
            problem = "is not a JSON mapping of settings"
        if not isinstance(stored, dict):
            raise ValueError(
                f"{self.settings_path} {problem}: it records the model, weights and settings of the samples in "
                f"{self.samples_path}. Restore it, use another output_dir, or overwrite=True (--overwrite true) to "
                "discard the samples."
            )
        return stored

    def check_settings(self, settings: dict[str, Any]) -> None:
        """Store ``settings`` on the first run; on a re-run refuse to mix samples drawn with different ones."""
        stored = self._stored_settings()
        if stored is not None:
            if self.samples:
                changed = {k: (stored.get(k), v) for k, v in settings.items() if stored.get(k) != v}
                for key in (WEIGHTS_KEY, MODEL_FILES_KEY):
                    if key in changed:
                        raise ValueError(self._model_changed(key, *changed[key], settings.get("model_name_or_path")))
                if changed:
                    details = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changed.items())
                    raise ValueError(
                        f"{self.output_dir} holds samples drawn with other settings ({details}). Use another "
                        "output_dir, or overwrite=True (--overwrite) to discard them."
                    )
        write_json_atomically(self.settings_path, settings)  # whole or not at all: a kill leaves no cut-off file

    def _model_changed(self, key: str, stored: dict | None, current: dict, model: str | None) -> str:
        short, described, cause = _CHANGES[key]
        if stored is None:
            what = f"{described} it has no record of (a store written without them)"
        else:
            files = sorted(k for k in stored.keys() | current.keys() if stored.get(k) != current.get(k))
            what = f"other {short}: {', '.join(files)} changed since (e.g. {cause.format(model=model)})"
        return (
            f"{self.output_dir} holds {len(self.samples)} samples drawn from {what}. Use another output_dir, or "
            f"overwrite=True (--overwrite true) to discard them and sample the current {short}."
        )

    def check_problems(self, benchmark: str, problems: Sequence[Problem]) -> None:
        """Refuse stored samples of a problem whose question or gold answer changed since they were drawn."""
        fingerprints = {p.problem_id: p.fingerprint for p in problems}
        for (name, problem_id, _), record in self.samples.items():
            if name == benchmark and problem_id in fingerprints and record["fingerprint"] != fingerprints[problem_id]:
                raise ValueError(
                    f"Stored samples of {benchmark!r} problem {problem_id} were drawn for a different question or "
                    f"answer (the data changed). Use another output_dir or overwrite=True."
                )

    def append(self, records: Iterable[dict]) -> None:
        """Append records and flush them to disk; if that fails (a full disk), ``samples.jsonl`` is cut back to the
        samples stored before, and none of ``records`` is kept."""
        records = list(records)
        size = os.path.getsize(self.samples_path) if os.path.exists(self.samples_path) else 0
        try:
            with open(self.samples_path, "a") as f:
                f.writelines(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
                f.flush()
                os.fsync(f.fileno())
        except OSError:
            try:
                os.truncate(self.samples_path, size)
            except OSError:  # then the next run drops the cut-off last line
                pass
            raise
        for record in records:
            self.samples[(record["benchmark"], record["problem_id"], record["sample_index"])] = record

    def get(self, benchmark: str, problem_id: int, sample_index: int) -> dict | None:
        return self.samples.get((benchmark, problem_id, sample_index))


def pending_jobs(
    store: SampleStore,
    benchmark: ResolvedBenchmark,
    problems: Sequence[Problem],
    prompt_ids: Sequence[Sequence[int]],
    seed: int,
) -> list[SampleJob]:
    """The samples of ``benchmark`` not yet in ``store``, in (problem, sample) order, each with its own seed."""
    jobs = []
    for problem, ids in zip(problems, prompt_ids, strict=True):
        for index in range(benchmark.num_samples):
            if store.get(benchmark.name, problem.problem_id, index) is None:
                job_seed = sample_seed(seed, benchmark.name, problem.problem_id, index)
                jobs.append(
                    SampleJob(benchmark.name, problem.problem_id, index, problem.fingerprint, tuple(ids), job_seed)
                )
    return jobs
