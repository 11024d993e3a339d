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

.PHONY: venv test test-transformers-4.57 demo bench clean mutation

venv: $(STAMP)

# The install order matters here (docs/usage.md, "Supported versions"): torch first from the pinned
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

# Two test processes (pytest-xdist), one test file each at a time: a file's module fixtures
# are built once, and the multi-process tests leave a core idle while they wait.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile

test: $(STAMP)
	$(PYTEST) tests

# The LLaMA-Factory, contract and vision-stage tests again on transformers 4.57.6 (what most LLaMA-Factory 0.9.x GPU
# users run), laid over the default environment without touching it.
TF457 := .venv-transformers-4.57
TF457_STAMP := $(TF457)/.odb-factory-installed
$(TF457_STAMP): $(STAMP) constraints-transformers-4.57.txt
	rm -rf $(TF457)
	$(PIP) install -q --no-deps --target $(TF457) -r constraints-transformers-4.57.txt
	touch $@

test-transformers-4.57: $(TF457_STAMP)
	PYTHONPATH=$(CURDIR)/$(TF457) $(PYTEST) tests/llamafactory tests/patches tests/encoder_stage

demo: $(STAMP)
	$(PY) -m odb_factory.demo

bench: $(STAMP)
	$(PY) -m bench.run --quick=$(QUICK)

# Mutation testing, a part at a time; not part of `make test` or CI (hours on 2 cores):
#   make mutation PART=core          planning/, balance/, cost and loss, with the in-process tests
#   make mutation PART=comm          comm/ with tests/comm (real gloo ranks)
#   make mutation PART=loader        loader/ with tests/loader, tests/comm and the public-API tests
#   make mutation PART=llamafactory  llamafactory/ with tests/llamafactory (the stock CLI)
# mutmut mutates a copy under build/mutation/PART (the working tree is never touched), with
# hypothesis stopping at the first failing example (tests/conftest.py's "mutation" profile: no
# shrinking) and each mutant's fastest tests first. The mutated copy comes first on PYTHONPATH, so
# every process a test starts (gloo ranks, torchrun workers, DataLoader workers) runs the mutant;
# tests/helpers/mutation_site credits the functions those processes reach to the test that started
# them. mutmut's workers fork from a server that has not run torch, and torch runs single-threaded
# (a fork after torch's thread pool started can hang). Afterwards
# `cd build/mutation/PART && ../../../.venv/bin/mutmut show NAME` prints a mutant's diff and
# `../../../.venv/bin/mutmut run NAME...` re-runs chosen mutants; the target itself starts afresh.
PART ?= core
MUTATE_core := odb_factory/planning/* odb_factory/balance/* odb_factory/cost.py odb_factory/loss.py
TESTS_core := tests/planning tests/balance tests/encoder_stage tests/test_cost.py tests/test_loss_exact.py
MARK_core := not slow
MUTATE_comm := odb_factory/comm/*
TESTS_comm := tests/comm
MUTATE_loader := odb_factory/loader/*
TESTS_loader := tests/loader tests/comm tests/test_public_api.py tests/test_cost.py
MUTATE_llamafactory := odb_factory/llamafactory/*
TESTS_llamafactory := tests/llamafactory tests/patches
# MUTATE narrows a part: make mutation PART=core MUTATE='odb_factory/balance/assignment.py'
MUTATE ?= $(MUTATE_$(PART))
MUTATION_TESTS ?= $(TESTS_$(PART))
MUTATION_MARK ?= $(MARK_$(PART))
MUTATION_DIR := build/mutation/$(PART)
mutation: $(STAMP)
	test -n "$(MUTATE)" || { echo "unknown PART=$(PART): use core, comm, loader or llamafactory"; exit 2; }
	rm -rf $(MUTATION_DIR)
	mkdir -p $(MUTATION_DIR)/hits $(MUTATION_DIR)/mutants  # on PYTHONPATH before mutmut fills it
	cp -r --parents odb_factory tests/__init__.py $(wildcard tests/conftest.py tests/*/conftest.py) tests/helpers \
	  $(MUTATION_TESTS) $(MUTATION_DIR)/
	find $(MUTATION_DIR) -name __pycache__ -prune -exec rm -rf {} +
	printf '%s\n' '[mutmut]' 'source_paths = odb_factory' \
	  'only_mutate =' $(addprefix '    ,$(addsuffix ',$(MUTATE))) \
	  'do_not_mutate =' '    */__init__.py' \
	  'process_isolation = forkserver' \
	  'pytest_add_cli_args =' '    -p' '    no:cacheprovider' \
	  $(if $(MUTATION_MARK),'    -m' '    $(MUTATION_MARK)') \
	  'pytest_add_cli_args_test_selection =' $(addprefix '    ,$(addsuffix ',$(MUTATION_TESTS))) \
	  '[tool:pytest]' 'timeout = 600' 'markers =' '    slow: multi-process or end-to-end tests' \
	  > $(MUTATION_DIR)/setup.cfg
	# a mutant that waits forever fails at the tests' timeout (mutmut's own wall-clock limit grows with
	# the covering tests' durations); one that loops while appending fails on memory (8 GB) instead
	# of swapping the machine
	cd $(MUTATION_DIR) && ulimit -v 8000000 && HYPOTHESIS_PROFILE=mutation OMP_NUM_THREADS=1 \
	  PYTHONPATH=$(CURDIR)/$(MUTATION_DIR)/mutants:$(CURDIR)/$(MUTATION_DIR)/tests/helpers/mutation_site \
	  ODB_MUTATION_HITS=$(CURDIR)/$(MUTATION_DIR)/hits $(CURDIR)/$(PY) -m mutmut run
	cd $(MUTATION_DIR) && $(CURDIR)/$(PY) -m mutmut export-cicd-stats && cat mutants/mutmut-cicd-stats.json
	cd $(MUTATION_DIR) && $(CURDIR)/$(PY) -m mutmut results

clean:
	rm -rf $(VENV) $(TF457) build *.egg-info bench/results
