# Two commands on a fresh machine: `make run` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

CHROMIUM := /usr/bin/chromium

.PHONY: install browser run test lint format types migrations-check check bench clean

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

run: install
	$(PY) manage.py serve --demo 3

test: install browser
	$(PY) -m pytest

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

types: install
	$(VENV)/bin/mypy controlpanel routing

migrations-check: install
	$(PY) manage.py makemigrations --check --dry-run

check: lint types migrations-check test

bench: install
	$(PY) bench/overhead.py

clean:
	rm -rf $(VENV) var .pytest_cache .mypy_cache .ruff_cache
