# Two entry points that work on a fresh machine: `make demo` and `make test`.
# Both create .venv on first use (idempotent: the stamp is rebuilt only when the pins change).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.odb-factory-installed
QUICK ?= 0
# Offline: no model or data hub is reachable from the machines this runs on.
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: venv test demo bench clean

venv: $(STAMP)

# The install order matters here (see README, "Installing"): torch first from the pinned
# releases, torchaudio without its dependencies (LLaMA-Factory imports it; other combinations
# fail to load its shared library), then the project with its LLaMA-Factory/DeepSpeed extras,
# then verl without its dependencies (bench/balance_bench.py's comparator: they exclude our
# transformers pin and pull in ray; the one verl file it loads needs only torch).
$(STAMP): setup.cfg constraints.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q torch==2.14.1 torchvision==0.29.1
	$(PIP) install -q --no-deps torchaudio==2.11.0
	$(PIP) install -q -c constraints.txt -e '.[llamafactory,dev,bench]'
	$(PIP) install -q --no-deps -c constraints.txt verl
	$(PY) -m odb_factory.install_hook
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests

demo: $(STAMP)
	$(PY) -m odb_factory.demo

bench: $(STAMP)
	$(PY) -m bench.run --quick=$(QUICK)

clean:
	rm -rf $(VENV) build *.egg-info bench/results
