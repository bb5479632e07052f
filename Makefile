# `make fit`: set up and run the demo.  `make test`: set up and run the test suite.
VENV ?= .venv
STAMP := $(VENV)/.ctr-lightning-setup
PYTEST_ARGS ?=
# The suite runs in this many processes (pytest-xdist), a test file each at a time: many of its
# tests wait on processes they start, so two share two cores well.
PYTEST_WORKERS ?= 2

.PHONY: setup fit test bench clean

setup: $(STAMP)

# The stamp makes a second `make` instant; it is redone when the install inputs change.
$(STAMP): pyproject.toml scripts/setup_env.sh
	bash scripts/setup_env.sh $(VENV)
	touch $(STAMP)

fit: setup
	$(VENV)/bin/ctr-lightning fit --config configs/demo.yaml

test: setup
	$(VENV)/bin/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

bench: setup
	$(VENV)/bin/python benchmarks/bench_synthetic.py

clean:
	rm -rf runs lightning_logs bench_out
