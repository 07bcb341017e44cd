# `make serve` and `make test` do all set-up on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kestrel-installed

.PHONY: setup test lint serve clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: a wheel of 2.13.0 (CPU) is on disk; anything else downloads several GB.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,router]'
	# The image-processor oracle (transformers' Kimi_K25ImageProcessor) needs torchvision, whose only wheel beside
	# CPU torch 2.13 is CUDA-built: installed into the venv it breaks every transformers import, so it goes to a
	# side folder that tests/hf_fixtures.py puts on the path of one child process.
	$(PY) -m pip install -q --no-deps --target $(VENV)/oracle-torchvision torchvision==0.28.0
	touch $(STAMP)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(VENV)/bin/pytest -q

serve: setup
	$(VENV)/bin/kestrel serve

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
