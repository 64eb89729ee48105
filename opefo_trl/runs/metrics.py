"""The metrics files of ``opefo-train`` (``metrics.jsonl``, or one per process): :func:`read_metrics_lines` drops a
cut-off last line (what a kill leaves) and refuses a corrupt line before it.

Example:
    >>> from opefo_trl.runs import read_metrics_lines
    >>> lines, cut_off = read_metrics_lines("runs/opefo-7b/metrics.jsonl")  # doctest: +SKIP
"""

from __future__ import annotations

import os

from opefo_trl.runs.files import METRICS_RE, TRAINER_STATE_NAME, MetricsFileError, read_json_lines


def read_metrics_lines(path: str) -> tuple[list[str], bool]:
    """The lines of a metrics file (JSON objects, each ending in a newline), and whether its last line was cut off
    (not valid JSON: what a kill during a write leaves) and dropped.

    Raises:
        MetricsFileError: a line before the last is not a JSON object (naming it and the fix).
    """

    def refuse(number: int, line: str) -> MetricsFileError:
        return MetricsFileError(
            f"{path}, line {number}, is not a metrics record: {line.strip()[:80]!r}. Resuming appends to this "
            "file and opefo-plot reads it: fix or delete that line (every logged step is also in the "
            f"checkpoints' {TRAINER_STATE_NAME}), or start afresh with --overwrite_output_dir true."
        )

    rows, cut_off = read_json_lines(path, refuse)
    for number, line, record in rows:
        if not isinstance(record, dict):
            raise refuse(number, line)
    return [line if line.endswith("\n") else line + "\n" for _, line, _ in rows], cut_off


def metrics_files(output_dir: str) -> list[str]:
    """Paths of the metrics files (``metrics.jsonl``, ``metrics.rank<N>.jsonl``) of ``output_dir``."""
    if not os.path.isdir(output_dir):
        return []
    return [os.path.join(output_dir, n) for n in sorted(os.listdir(output_dir)) if METRICS_RE.match(n)]
