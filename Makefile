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

# Mutation testing of the pure core; not part of `make test` or CI (it takes hours on 2 cores).
# mutmut mutates a copy under build/mutation (the working tree is never touched) and runs only
# the fast in-process tests on each mutant, with hypothesis stopping at the first failing example
# (tests/conftest.py's "mutation" profile: no shrinking). Workers fork from a server that has not
# run torch, and torch runs single-threaded (a fork after torch's thread pool started can hang).
# Afterwards `cd build/mutation && ../../.venv/bin/mutmut show NAME` prints a mutant's diff and
# `../../.venv/bin/mutmut run NAME...` re-runs chosen mutants; the target itself starts afresh.
MUTATION_DIR := build/mutation
MUTATION_TESTS := tests/planning tests/balance tests/encoder_stage tests/test_cost.py tests/test_loss_exact.py
# what is mutated; a part at a time fits a shorter sitting: make mutation MUTATE='odb_factory/balance/assignment.py'
MUTATE ?= odb_factory/planning/* odb_factory/balance/* odb_factory/cost.py odb_factory/loss.py
mutation: $(STAMP)
	rm -rf $(MUTATION_DIR)
	mkdir -p $(MUTATION_DIR)
	cp -r --parents odb_factory tests/__init__.py tests/conftest.py tests/helpers $(MUTATION_TESTS) $(MUTATION_DIR)/
	find $(MUTATION_DIR) -name __pycache__ -prune -exec rm -rf {} +
	printf '%s\n' '[mutmut]' 'source_paths = odb_factory' \
	  'only_mutate =' $(addprefix '    ,$(addsuffix ',$(MUTATE))) \
	  'do_not_mutate =' '    */__init__.py' \
	  'process_isolation = forkserver' \
	  'pytest_add_cli_args =' '    -p' '    no:cacheprovider' \
	  '    -m' '    not slow' \
	  'pytest_add_cli_args_test_selection =' $(addprefix '    ,$(addsuffix ',$(MUTATION_TESTS))) \
	  '[tool:pytest]' 'markers =' '    slow: multi-process or end-to-end tests' \
	  > $(MUTATION_DIR)/setup.cfg
	# a mutant that loops while appending fails on memory (8 GB) instead of swapping the machine
	cd $(MUTATION_DIR) && ulimit -v 8000000 && HYPOTHESIS_PROFILE=mutation OMP_NUM_THREADS=1 $(CURDIR)/$(PY) -m mutmut run
	cd $(MUTATION_DIR) && $(CURDIR)/$(PY) -m mutmut export-cicd-stats && cat mutants/mutmut-cicd-stats.json
	cd $(MUTATION_DIR) && $(CURDIR)/$(PY) -m mutmut results

clean:
	rm -rf $(VENV) $(TF457) build *.egg-info bench/results
