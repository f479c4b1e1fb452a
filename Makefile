# dspine-train: the commands a user types.
VENV      ?= .venv
PY        := $(VENV)/bin/python
PIP       := $(VENV)/bin/pip
export PATH := $(abspath $(VENV))/bin:$(PATH)
# DeepSpeed JIT-builds a CPU comm op on first use; keep the build inside the ignored tree.
export TORCH_EXTENSIONS_DIR := $(abspath .cache/torch_extensions)
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export WANDB_MODE ?= offline
export TOKENIZERS_PARALLELISM := false

.PHONY: install install-demo test lint demo bench gpu-check clean

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# The exact versions come from constraints.txt (pyproject.toml holds only ranges); its
	# torch pin applies to the whole command, or deepspeed would pull a CUDA torch.
	$(PIP) install --quiet -c constraints.txt -e ".[dev,prompts,serve]"
	# z-lab's DFlash reference client, which tests/test_dflash_format.py loads our exports with.
	# Without its dependencies: it pins datasets 5.0.1 and tqdm 4.70.0 against ours, and it
	# imports only torch and transformers (see pyproject.toml, `dev`).
	$(PIP) install --quiet --no-deps dflash==0.1.0
	# vLLM's speculators package, which tests/test_speculators_format.py loads our exports with.
	# Without its dependencies: it pins transformers<=5.19 and datasets<=5.1.0 against ours and
	# pulls torchvision/torchaudio. `import speculators` also imports its training stack, which
	# needs loguru, openai and hs-connectors: pure Python, their own dependencies already ours
	# (openai's distro and sniffio come with wandb; its jiter is imported only by its streaming
	# parser, which the `serve` extra brings for the server's tests).
	$(PIP) install --quiet --no-deps speculators==0.9.0 hs-connectors==0.9.0 loguru==0.7.3 \
		openai==2.54.0
	touch $@

install: $(VENV)/.installed

$(VENV)/.installed-demo: $(VENV)/.installed
	$(PIP) install --quiet -c constraints.txt -e ".[dev,prompts,demo]"
	touch $@

install-demo: $(VENV)/.installed-demo

lint: install
	$(VENV)/bin/ruff check .

test: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest -q tests

# The whole pipeline on the embedded Qwen2.5-Coder-0.5B target (CPU); stages are cached.
demo: install-demo
	$(PY) scripts/demo.py

# Benchmarks that need no real model; bench_data.py and bench_engine.py run on the demo's
# target and draft (`make demo` first, then see their --help).
bench: install
	$(PY) scripts/bench_token_table.py
	$(PY) scripts/bench_train.py
	$(PY) scripts/bench_cpu_bf16.py

# One GPU, no network, one short run: environment and attention backends, `pytest -m gpu`,
# fp32 exactness, Qwen3-8B-shaped bf16 checks, step timings, memory against the plan.
gpu-check: install
	$(PY) scripts/gpu_check.py --device cuda --out docs/results/gpu_check

clean:
	rm -rf .cache artifacts outputs multirun
