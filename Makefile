# `make demo` serves the default model (SmolLM2-135M-Instruct, fetched once) and streams answers.
# `make test` runs the test suite (unit, integration against the real RabbitMQ, kernels), then
# the Compose check where Docker can run (one "compose-check SKIPPED" line where it cannot).
# `make compose-check` builds the images and runs the real Compose stack alone (minutes).
PYTHON ?= python3
export PYTHON
# The Compose check inside `make test`: Locust for 20 s instead of 60 (the suite's time budget).
COMPOSE_CHECK_CI_ARGS ?= --duration 20s

.PHONY: setup broker demo test lint bench compose-check
setup:
	bash scripts/setup.sh

broker:
	bash scripts/ensure_rabbitmq.sh

demo: setup broker
	bash scripts/demo.sh

test: setup broker
	$(PYTHON) -m pytest -q
	$(PYTHON) -m deploy.compose_check --skip-without-docker $(COMPOSE_CHECK_CI_ARGS)

lint:
	$(PYTHON) -m ruff check . && $(PYTHON) -m ruff format --check .

bench: setup broker
	$(PYTHON) -m loadtest bench --spawn

compose-check: setup
	$(PYTHON) -m deploy.compose_check
