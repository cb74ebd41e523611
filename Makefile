# `make demo` serves the default model (SmolLM2-135M-Instruct, fetched once) and streams answers.
# `make test` runs the test suite (unit, integration against the real RabbitMQ, kernels).
# `make compose-check` builds the images and runs the real Compose stack (minutes; not in `test`).
PYTHON ?= python3
export PYTHON

.PHONY: setup broker demo test lint bench compose-check
setup:
	bash scripts/setup.sh

broker:
	bash scripts/ensure_rabbitmq.sh

demo: setup broker
	bash scripts/demo.sh

test: setup broker
	$(PYTHON) -m pytest -q

lint:
	$(PYTHON) -m ruff check . && $(PYTHON) -m ruff format --check .

bench: setup broker
	$(PYTHON) -m loadtest bench --spawn

compose-check: setup
	$(PYTHON) -m deploy.compose_check
