# Everyday commands. `make help` lists them. Everything runs inside .venv, created on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The torch build to install. PyPI's Linux wheels carry CUDA; pin another build or index with e.g.
# `make setup TORCH="torch --index-url https://download.pytorch.org/whl/cu126"`.
TORCH ?= torch==2.13.0
ARGS ?=
# pytest-xdist processes for `make test`; whole files go to one worker (module fixtures are built once).
# 2 on the 2-core CI machine; WORKERS=0 runs in this process.
WORKERS ?= 2

.PHONY: help setup train test test-fast test-long test-all test-oldest test-newest lint format tensorboard plot clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

$(BIN)/.installed: pyproject.toml engine/pyproject.toml engine/requirements/*.txt requirements/*.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e ".[dev]"  # the engine with it, from engine/ (never by name)
# template-only:start (LitData, whose loader's resume the engine's suite checks, without the torchvision it lists: its
# streaming loader does not import it, and PyPI's torchvision fails to load beside a CPU build of torch)
	$(BIN)/pip install --quiet --no-deps "litdata>=0.2.50"
	$(BIN)/pip install --quiet boto3 filelock obstore requests tifffile urllib3
# template-only:end
	touch $@

setup: $(BIN)/.installed  ## create .venv with torch, the project and the dev tools

train: setup  ## train the default config (extra flags: make train ARGS="--trainer.devices 4")
	$(BIN)/python -m project fit $(ARGS)

test: setup  ## your tests and the engine's self-check on your module (~2 min); make test-long adds the rest
	$(BIN)/python -m pytest -n $(WORKERS) --dist loadfile -m "not long" $(ARGS)
# template-only:start (the engine's own suite, engine/tests, stays with the engine: the template runs it, copies don't)
	cd engine && ../$(BIN)/python -m pytest -n $(WORKERS) --dist loadfile -m "not long" $(ARGS)
# template-only:end

test-fast: setup  ## the in-process tests only (~1 min)
	$(BIN)/python -m pytest -n $(WORKERS) --dist loadfile -m "not slow and not long" $(ARGS)
# template-only:start
	cd engine && ../$(BIN)/python -m pytest -n $(WORKERS) --dist loadfile -m "not slow and not long" $(ARGS)
# template-only:end

test-long: setup  ## only what make test leaves out (marked long): the same guarantees in other settings
	$(BIN)/python -m pytest -n $(WORKERS) --dist loadfile -m long $(ARGS) || [ $$? = 5 ]  # 5: none marked long
# template-only:start
	cd engine && ../$(BIN)/python -m pytest -n $(WORKERS) --dist loadfile -m long $(ARGS)
# template-only:end

test-all: test test-long  ## the whole suite: make test and make test-long (CI runs both)

test-oldest:  ## the fast tests on the oldest versions the requirements files allow, in .venv-oldest (CI runs it)
	$(PYTHON) -m venv .venv-oldest
	.venv-oldest/bin/pip install --quiet --upgrade pip
	# torch at its floor too: a build from the registry (CUDA on x86_64, ~3 GB; it runs on the CPU)
	$(PYTHON) .ci/oldest_constraints.py > .venv-oldest/constraints.txt
	.venv-oldest/bin/pip install --quiet -c .venv-oldest/constraints.txt -e ".[dev]"
	.venv-oldest/bin/pip list 2>/dev/null | grep -iE '^(torch|lightning|jsonargparse|torchmetrics|tensorboard|scikit-learn) '
	.venv-oldest/bin/python -m pytest -n $(WORKERS) --dist loadfile -m "not slow and not long" -p no:cacheprovider $(ARGS)
# template-only:start
	cd engine && ../.venv-oldest/bin/python -m pytest -n $(WORKERS) --dist loadfile -m "not slow and not long" -p no:cacheprovider $(ARGS)
# template-only:end

test-newest:  ## the fast tests on the newest versions the requirements files allow, in .venv-newest (CI runs it)
	$(PYTHON) -m venv .venv-newest
	.venv-newest/bin/pip install --quiet --upgrade pip
	.venv-newest/bin/pip install --quiet $(TORCH)
	# every other dependency at its newest within pyproject.toml's ranges; torch stays the build installed above
	.venv-newest/bin/python -c "import torch; print('torch==' + torch.__version__)" > .venv-newest/constraints.txt
	.venv-newest/bin/pip install --quiet --upgrade --upgrade-strategy eager -c .venv-newest/constraints.txt -e ".[dev]"
	.venv-newest/bin/pip list 2>/dev/null | grep -iE '^(torch|lightning|jsonargparse|torchmetrics|tensorboard|scikit-learn) '
	.venv-newest/bin/python -m pytest -n $(WORKERS) --dist loadfile -m "not slow and not long" -p no:cacheprovider $(ARGS)
# template-only:start
	cd engine && ../.venv-newest/bin/python -m pytest -n $(WORKERS) --dist loadfile -m "not slow and not long" -p no:cacheprovider $(ARGS)
# template-only:end
# template-only:start (a copy has no scripts/new_project.py)
.PHONY: test-copy
test-copy: setup  ## a copy made by scripts/new_project.py runs its whole suite, both tiers (CI runs it)
	WORKERS=$(WORKERS) .ci/test_copy.sh $(ARGS)
# template-only:end

lint: setup  ## ruff lint and format check
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

format: setup  ## apply ruff's fixes and formatting
	$(BIN)/ruff check --fix . && $(BIN)/ruff format .

sweep: setup  ## run, or after a crash continue, configs/sweep.yaml (make sweep ARGS="--workers 2", ARGS=--show)
	$(BIN)/python -m project sweep --config configs/sweep.yaml $(ARGS)

tensorboard: setup  ## serve runs/ on http://127.0.0.1:6006 (ssh -L 6006:127.0.0.1:6006 from your laptop)
	$(BIN)/tensorboard --logdir runs --host 127.0.0.1 --port 6006

plot: setup  ## PNG of a run's curves: make plot RUN=runs/digits/version_0 (adds matplotlib on first use)
	$(BIN)/python -c "import matplotlib" 2>/dev/null || $(BIN)/pip install --quiet -e ".[plot]"
	$(BIN)/python scripts/plot_run.py $(RUN)

clean:  ## remove caches and build outputs (never runs/)
	rm -rf .pytest_cache .ruff_cache build dist *.egg-info
