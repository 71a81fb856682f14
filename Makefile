# Every target installs what it needs into $(VENV) first, from nothing.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
PYTEST_ARGS ?=
# test processes: the suite is mostly interpreters starting and waiting on sockets, so
# one per core keeps both cores busy; a test module runs whole on one of them
TEST_WORKERS ?= auto

.PHONY: install test lint demo bench clean help

help:
	@echo "make demo    compare sync / async / ssp on digits-mlp (about 2 min on 2 cores)"
	@echo "make test    run the test suite"
	@echo "make lint    ruff + mypy + import-linter (the layers import one way)"
	@echo "make bench   side-by-side benchmarks (raw zmq, torch RPC, gloo, Ray)"
	@echo "make install create $(VENV) with everything installed"

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH_PIN)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[dev]"
	touch $(STAMP)

test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15 $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check paramserver workers cli benchmarks tests
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

demo: install
	$(VENV)/bin/paramserver experiment --preset demo --out runs/demo --overwrite

# Ray, a peer in the benchmarks, is an extra: make test does not need it
bench: install
	$(PY) -m pip install -q --disable-pip-version-check -e ".[bench]"
	$(VENV)/bin/paramserver bench --out runs/bench

clean:
	rm -rf $(VENV) runs build *.egg-info .pytest_cache .mypy_cache .ruff_cache
