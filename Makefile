# horovod_aq — the two commands README.md starts with, and a few more.
#   make demo   set up what is missing, then train the PyTorch example on 2 local ranks, fp32
#               and ALQ 3-bit from the same seeds (0, 1, 2); prints the mean accuracies, the gap
#               and the byte ratio
#   make test   set up what is missing, then run the test suite without the slow matrix: the
#               single-process tests on 2 pytest workers (pytest-xdist), then the multi-process
#               launches one at a time (each already uses the cores with its ranks)
#   make test-slow  the slow matrix (pytest -m slow: second controllers and world sizes, the
#               benchmarks' quick runs, doctor --full); CI runs both
VENV      ?= .venv
PY        := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup demo test test-slow test-fast lint clean-venv

setup:
	@scripts/setup.sh --venv $(VENV)

demo: setup
	@$(PY) -m horovod_aq.tools.cli demo

# Two runs, so that the single-process tests use both cores (-n 2) while no launch competes with
# them for CPU; the launches' timeouts and stall checks assume they have the machine alone.
# Any failure fails the target, after both runs (exit 5, nothing collected, is not one:
# PYTEST_ARGS may name files of one kind).
TEST_WORKERS ?= 2

test: setup
	@status=0; \
	$(PY) -m pytest -m "not multiprocess and not slow" -n $(TEST_WORKERS) --dist loadfile \
		$(PYTEST_ARGS) || { rc=$$?; [ $$rc = 5 ] || status=$$rc; }; \
	$(PY) -m pytest -m "multiprocess and not slow" $(PYTEST_ARGS) \
		|| { rc=$$?; [ $$rc = 5 ] || status=$$rc; }; \
	exit $$status

# The slow matrix, which pyproject.toml's addopts leave out of `make test`.
test-slow: setup
	@$(PY) -m pytest -m slow $(PYTEST_ARGS)

# Single-process tests only (no Horovod launches): quick feedback while developing.
test-fast: setup
	@$(PY) -m pytest -m "not multiprocess and not slow" $(PYTEST_ARGS)

lint: setup
	@$(VENV)/bin/ruff check horovod_aq tests benchmarks examples

clean-venv:
	rm -rf $(VENV)
