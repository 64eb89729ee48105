#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py; benchmarks/README.md): one command on a single-GPU machine that has
# PyTorch and transformers but no network. What it lacks travels as wheels in .whl/ at the repository root
# (benchmarks/fetch_wheels.sh), installed into a private folder; the repository itself is used in place.
#
#   bash benchmarks/gpu_check.sh OUT                # stages 0-3, within --deadline_s (510 s) plus the install
#   bash benchmarks/gpu_check.sh OUT --stages 2     # rerun one stage; the report keeps the other stages' results
#
# Writes OUT/stageN.json and OUT/stageN.log (8 files) and prints the markdown report.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu-check}"
shift || true
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/opefo-site \
        .whl/*.whl || { echo "gpu_check.sh: installing .whl/*.whl failed" >&2; exit 1; }
    export PYTHONPATH="/tmp/opefo-site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 DS_BUILD_OPS=0
exec python3 benchmarks/gpu_check.py --output_dir "$out" "$@"
