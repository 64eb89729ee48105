#!/usr/bin/env bash
# The prepared GPU check (benchmarks/gpu_check.py): one call on a single-GPU machine that has PyTorch and transformers
# but no network. Pure-Python packages it lacks (trl, datasets, math-verify, ...) travel as wheels in .whl/ at the
# repository root, installed into a private folder:
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#       trl==1.16.0 datasets==5.2.0 transformers==5.24.0 dill==0.4.1 multiprocess==0.70.19 regex==2026.11.19 \
#       math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
#   bash benchmarks/gpu_check.sh OUTPUT_DIR [gpu_check.py options]   # about 6 minutes on one H200 with the defaults
#
# Writes OUTPUT_DIR/gpu_check.json, OUTPUT_DIR/gpu_check.md and OUTPUT_DIR/versions.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu-check}"
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/opefo-site .whl/*.whl
    export PYTHONPATH="/tmp/opefo-site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
{
    nvidia-smi -L || true
    python3 -c "import sys, torch, transformers, trl, datasets; print(sys.version); print('torch', torch.__version__, torch.version.cuda); print('transformers', transformers.__version__, 'trl', trl.__version__, 'datasets', datasets.__version__)"
} | tee "$out/versions.txt"
python3 benchmarks/gpu_check.py --output_dir "$out" "${@:2}"
