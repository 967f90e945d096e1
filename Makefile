# Longhaul: `make run` serves the product on the embedded SQLite default;
# `make test` runs the whole suite on PostgreSQL, Playwright included.

PYTHON ?= python3
PORT ?= 8000
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_DATABASE_URL ?= $(if $(DATABASE_URL),$(DATABASE_URL),postgres://longhaul:longhaul@127.0.0.1:5432/longhaul)
PYTEST := $(BIN)/pytest
# The translations: the .po files are committed, the .mo files compiled from them (.gitignore).
COMPILEMESSAGES := $(BIN)/python manage.py compilemessages --ignore='.*' --ignore=var --verbosity 0

.PHONY: run test test-unit test-smoke test-e2e bench venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Longhaul needs Python 3.11 or newer")'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

# Development mode: tracebacks, a generated secret key under var/, the debug task kinds. Both default off.
run: export DEBUG ?= 1
run: export LONGHAUL_DEBUG_DRIVERS ?= 1
run: venv
	mkdir -p var
	bin/ensure-gettext
	bin/ensure-pydocs
	$(COMPILEMESSAGES)
	$(BIN)/python manage.py migrate --noinput
	$(BIN)/python manage.py seed_demo
	@echo ""
	@echo "  Longhaul: http://127.0.0.1:$(PORT)/   (sign in as demo / longhaul-demo; Ctrl-C stops)"
	@echo ""
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/honcho start -f Procfile -p $(PORT)

# The suite on PostgreSQL in TEST_PROCESSES processes (pytest-xdist; each has a test database of its own), then
# the fault drill alone (it restarts PostgreSQL under everyone's connections), a smoke subset on SQLite, then
# Playwright in its own pytest invocation (its event loop clashes with asyncio tests in one process). The suite
# runs the product in development mode, as `make run` does (tests/settings.py says why). --dist worksteal: a
# process that ends its share early takes tests off the other's. (The 29 API fuzz cases share one test id, so a
# count of distinct ids comes out 28 short of the tests run: none is missing.)
TEST_PROCESSES ?= 2
test test-unit: export DEBUG ?= 1
test: venv
	bin/ensure-postgres
	bin/ensure-redis
	bin/ensure-chromium
	bin/ensure-gettext
	bin/ensure-pydocs
	$(COMPILEMESSAGES)
	DATABASE_URL='$(TEST_DATABASE_URL)' $(PYTEST) -p no:playwright -n $(TEST_PROCESSES) --dist worksteal --durations=20 \
		-m 'not e2e and not alone' tests
	LONGHAUL_DRILL_PG_RESTART=1 DATABASE_URL='$(TEST_DATABASE_URL)' $(PYTEST) -p no:playwright -m 'alone' tests
	DATABASE_URL='sqlite:///$(CURDIR)/var/smoke.sqlite3' $(PYTEST) -p no:playwright -m 'smoke and not e2e' tests
	DATABASE_URL='$(TEST_DATABASE_URL)' $(PYTEST) -m e2e tests/e2e

test-unit: venv
	$(PYTEST) -p no:playwright tests/unit

# Benchmarks, each beside a baseline measured in the same run; writes BENCHMARKS.md.
# A database of its own: the ORM broker table is shared with any qcluster on the same database.
BENCH_DATABASE_URL ?= postgres://longhaul:longhaul@127.0.0.1:5432/longhaul_bench
bench: venv
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test,bench]'
	bin/ensure-postgres
	bin/ensure-redis
	DATABASE_URL='$(BENCH_DATABASE_URL)' REDIS_URL='redis://127.0.0.1:6379/0' $(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) var
