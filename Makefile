# `make serve` and `make test` do all set-up on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kestrel-installed

# Shared libraries the Mooncake transfer engine (the `pd` extra) loads; librdmacm1 for its RDMA transport. g++: the
# compiler torch.utils.cpp_extension builds Kestrel's CPU kernels with (kestrel/models/layers/*_cpu.cpp).
SYSTEM_LIBS := libibverbs1 librdmacm1 libnuma1 libcurl4 g++

.PHONY: setup system-libs test lint serve clean

setup: system-libs $(STAMP)

# apt-get only for what is missing (dpkg -s is instant), as root or through sudo; skipped off Debian.
system-libs:
	@command -v dpkg >/dev/null || { echo "no dpkg: install $(SYSTEM_LIBS) yourself"; exit 0; }; \
	missing=$$(for p in $(SYSTEM_LIBS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		echo "installing $$missing (the Mooncake transfer engine's libraries, the kernels' compiler)"; \
		$$sudo apt-get update -qq && $$sudo apt-get install -y -qq --no-install-recommends $$missing; \
	fi

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: a wheel of 2.13.0 (CPU) is on disk; anything else downloads several GB.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,router,pd]'
	# The image-processor oracle (transformers' Kimi_K25ImageProcessor) needs torchvision, whose only wheel beside
	# CPU torch 2.13 is CUDA-built: installed into the venv it breaks every transformers import, so it goes to a
	# side folder that tests/hf_fixtures.py puts on the path of one child process.
	$(PY) -m pip install -q --no-deps --target $(VENV)/oracle-torchvision torchvision==0.28.0
	# Build the compiled CPU kernels now (~25 s, once per Python environment) rather than in the first engine start.
	$(PY) -c "from kestrel.models.layers import cpu_kernels; cpu_kernels.module()"
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
