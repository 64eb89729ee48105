"""Running a notebook under notebooks/ in a fresh kernel of this interpreter, for tests/test_notebooks.py (smoke mode)
and tests/real_model/test_real_quickstart.py (the real path on a local model).

The kernel runs ``sys.executable`` from a kernelspec written to a temporary folder (no Jupyter installation or user
kernelspec is involved) and imports this checkout's opefo_trl. Values can be given to the notebook's
``parameters``-tagged cell as papermill does: a cell inserted right after it. A probe cell appended after the
notebook's own cells prints a JSON summary of what the notebook computed, which the caller checks.
"""

import json
import os
import sys
from pathlib import Path

import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

REPO_ROOT = Path(__file__).resolve().parent.parent
KERNEL_NAME = "opefo-trl-test"
PROBE_MARKER = "OPEFO_NOTEBOOK_PROBE "
CELL_TIMEOUT_S = 300


def write_kernelspec(root: Path) -> Path:
    """A kernelspec for this interpreter under ``root`` (returned), so the notebooks run in the tests' environment."""
    spec_dir = root / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "opefo-trl tests",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    return root


def execute_notebook(
    path: Path, kernel_dir: Path, workdir: Path, monkeypatch, probe: str | None, parameters: str | None = None
) -> dict:
    """Run ``path`` in ``workdir``, offline, with ``parameters`` (Python source) run right after its parameters cell;
    return the JSON of the ``probe`` expression evaluated after the last cell (``{}`` without a probe). Any cell
    error raises nbclient's CellExecutionError, naming the cell and its traceback."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    # The kernel imports this checkout's opefo_trl even where the package is not installed.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    nb = nbformat.read(path, as_version=4)
    if parameters is not None:
        (index,) = [i for i, cell in enumerate(nb.cells) if "parameters" in cell.metadata.get("tags", [])]
        nb.cells.insert(index + 1, nbformat.v4.new_code_cell(parameters))
    if probe is not None:
        nb.cells.append(
            nbformat.v4.new_code_cell(
                f"import json as _json, os, sys\nprint({PROBE_MARKER!r} + _json.dumps({probe.strip()}))"
            )
        )
    km = KernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernel_dir)]))
    client = NotebookClient(
        nb, km=km, timeout=CELL_TIMEOUT_S, allow_errors=False, resources={"metadata": {"path": str(workdir)}}
    )
    client.execute()
    if probe is None:
        return {}
    for output in nb.cells[-1].outputs:
        if output.get("output_type") == "stream" and PROBE_MARKER in output.get("text", ""):
            return json.loads(output["text"].split(PROBE_MARKER, 1)[1])
    raise AssertionError(f"The probe cell of {path.name} printed nothing: {nb.cells[-1].outputs}")
