"""opefo_trl.runs.metrics: a metrics file a kill cut short, and one with a corrupt line."""

import pytest

from opefo_trl.runs import MetricsFileError, read_metrics_lines


def test_a_cut_off_last_metrics_line_is_dropped_and_a_corrupt_one_before_it_refused(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n\n{"step": 2}\n{"step": 3, "lo')
    assert read_metrics_lines(str(path)) == (['{"step": 1}\n', '{"step": 2}\n'], True)
    path.write_text('{"step": 1}\n{"step": 2}')  # whole, without its newline
    assert read_metrics_lines(str(path)) == (['{"step": 1}\n', '{"step": 2}\n'], False)
    path.write_text('{"step": 1}\n{"st\n{"step": 3}\n')
    with pytest.raises(MetricsFileError) as error:
        read_metrics_lines(str(path))
    assert str(error.value) == (
        f"{path}, line 2, is not a metrics record: '{{\"st'. Resuming appends to this file and opefo-plot reads it: "
        "fix or delete that line (every logged step is also in the checkpoints' trainer_state.json), or start "
        "afresh with --overwrite_output_dir true."
    )
