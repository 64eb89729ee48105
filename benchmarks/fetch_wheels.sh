#!/usr/bin/env bash
# Put the wheels of benchmarks/gpu_wheels.txt into .whl/ (ignored by git) for a GPU machine without network:
# Python 3.12, manylinux x86-64. DeepSpeed ships a source distribution only: its wheel is built here with
# DS_BUILD_OPS=0 (pure Python; no op is compiled, and the check uses none: the JSON configs leave the optimizer to
# the Trainer, torch's AdamW). The build imports torch, so it runs in this repository's .venv (`make install`).
#
#   bash benchmarks/fetch_wheels.sh            # then: bash benchmarks/gpu_check.sh OUT on the GPU machine
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
dest=.whl
mkdir -p "$dest"
mapfile -t wanted < <(grep -v '^\s*#' benchmarks/gpu_wheels.txt | grep -v '^\s*$')
binary=()
for requirement in "${wanted[@]}"; do
    [[ "$requirement" == deepspeed==* ]] || binary+=("$requirement")
done
"$python" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dest" "${binary[@]}"
for requirement in "${wanted[@]}"; do
    if [[ "$requirement" == deepspeed==* ]]; then
        DS_BUILD_OPS=0 "$python" -m pip wheel --no-deps --no-build-isolation -w "$dest" "$requirement"
    fi
done
ls -l "$dest"
du -ch "$dest"/*.whl | tail -1
