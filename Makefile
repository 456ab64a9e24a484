# Two commands do all the set-up on a fresh machine (CPython 3.11, Java 17 and Maven needed):
#   make demo   - the whole pipeline on the embedded Kafka broker and the Mooncake trace
#   make test   - the linter (make lint), then unit tests and integration tests against a real broker (-rs: each
#                 skipped test's reason)
#   make lint   - ruff check . (the rules of [tool.ruff] in pyproject.toml)
#   make bench  - the benchmark (bench/results.json, bench/results.png)
#   make chaos  - the fault scenarios (worker crash, rebalance, broker outage, bridge restart, table recovery, engine crash, broker bounces)
#   make compose-test - docker-compose.yml brought up and checked against the ground truth (needs Docker)
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test lint bench chaos broker-start broker-stop clean images-local compose-test

# the compiled hot path and the index table are built by the install: a changed .pyx or setup.py installs again
$(STAMP): pyproject.toml setup.py schemas/_avro.pxd schemas/_hotpath.pyx stream_apps/residency/_record.pyx \
		stream_apps/index/_table.pyx
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: $(PYTHON) not found (set PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,bench,analytics]'
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvstream demo $(DEMO_ARGS)

chaos: $(STAMP)
	$(PY) -m chaos $(CHAOS_ARGS)

# ruff's report on standard output and a non-zero exit on any violation, so a lint error fails `make test`
lint: $(STAMP)
	$(PY) -m ruff check .

test: $(STAMP) lint
	$(PY) -m pytest -rs $(PYTEST_ARGS)

# every benchmark figure into bench/results.json and bench/results.png; BENCH_ARGS="--quick" for a smoke run
bench: $(STAMP)
	$(PY) -m bench $(BENCH_ARGS)

broker-start: $(STAMP)
	$(VENV)/bin/kvstream broker start

broker-stop: $(STAMP)
	$(VENV)/bin/kvstream broker stop

# Stand-ins for python:3.11-slim, apache/kafka and the schema registry's image, built from Debian packages on a
# machine that cannot pull images (docs/deployment.md); needs root, docker, debootstrap and mvn.
images-local: $(STAMP)
	KVSTREAM_PY=$(abspath $(PY)) deploy/images-local.sh

# Not part of `make test`: installs nothing, prints a SKIPPED line where Docker or Compose is missing.
compose-test:
	$(PYTHON) deploy/compose_test.py $(COMPOSE_TEST_ARGS)

clean:
	rm -rf $(VENV) .kvstream *.egg-info
