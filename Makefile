# Set-up and checks. Every target creates .venv on first use; only Python 3.11+,
# Java 17+ and make are needed on the machine (and, for the status-page test, Debian's
# chromium and chromium-driver, which `make browser` installs when it can).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Spark's Python workers must hash str keys like the driver does (portable_hash).
export PYTHONHASHSEED := 0

.PHONY: test demo lint typecheck unit bench docs clean browser

# The editable install's build warns (in a box) that folders named like the package may
# shadow it on import: here they are the package (package-dir), so the box is noise.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	PYTHONWARNINGS='ignore:Editable installation' $(BIN)/python -m pip install --quiet -e '.[test,bench]'
	$(BIN)/python -c 'from ftlayer.integration.source.columnar import compile_kernels; compile_kernels()'
	$(BIN)/python -c 'from ftlayer.acking.u64map import compile_kernels; compile_kernels()'
	$(BIN)/python -c 'from ftlayer.persistence.kernels import compile_kernels; compile_kernels()'
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check ftlayer persistence partitioners integration

# mypy cannot follow the package-dir mapping through the editable install, so it
# checks a link tree that has the installed layout: .typecheck/ftlayer/{persistence,...}.
typecheck: $(STAMP)
	rm -rf .typecheck && mkdir -p .typecheck/ftlayer
	for f in ftlayer/*; do ln -s "../../$$f" .typecheck/ftlayer/; done
	for d in persistence partitioners integration; do ln -s "../../$$d" .typecheck/ftlayer/$$d; done
	$(BIN)/mypy -p ftlayer

# The tests that mostly wait (the cluster on hosts of network namespaces, the kill and
# restart tests of Kafka and of receivers, the FT layer's outages under a query, slow
# batches, the demos, the shard outage, rewind and resharding) run beside the rest of
# the suite, in a pytest of their own whose output follows the main run's: both
# together take about as long as the main run alone.
BESIDE := tests/integration/test_cluster_hosts.py tests/integration/test_recovery_kills.py \
	tests/integration/test_demo.py tests/integration/test_savepoint_shards.py \
	tests/integration/test_shard_rewind.py tests/integration/test_shard_outage.py \
	tests/integration/test_ingest_kills.py tests/integration/test_server_restarts.py \
	tests/integration/test_slow_batches.py
unit: $(STAMP)
	@$(BIN)/pytest -q -p no:cacheprovider --durations=10 --basetemp=.pytest-beside $(BESIDE) \
		> .pytest-beside.log 2>&1 & beside=$$!; \
	$(BIN)/pytest -q --durations=25 $(foreach f,$(BESIDE),--ignore=$(f)); main=$$?; \
	wait $$beside; other=$$?; \
	echo "---- run beside the rest: $(BESIDE)"; cat .pytest-beside.log; \
	exit $$(( main != 0 || other != 0 ))

# Headless Chromium for tests/integration/test_status_page.py: apt-get install when
# missing (root, or sudo without a password); otherwise a note, and the test skips.
browser:
	.ci/install-browser

test: lint typecheck browser unit

# The main job on an embedded broker, an FT-layer process and local Spark; options
# through DEMO_ARGS, e.g. make demo DEMO_ARGS="--records 20000 --kill-workers 2 --json".
DEMO_ARGS ?=
demo: $(STAMP)
	$(BIN)/ftlayer demo $(DEMO_ARGS)

bench: $(STAMP)
	$(BIN)/ftlayer bench acker
	$(BIN)/ftlayer bench persist
	$(BIN)/ftlayer bench server

# Tables in the docs that are generated from the code (a test fails when they drift).
docs: $(STAMP)
	$(BIN)/python -c 'from pathlib import Path; from ftlayer.integration.source.options import write_markdown_table; write_markdown_table(Path("docs/user-guide.md"))'

clean:
	rm -rf $(VENV) .typecheck .pytest_cache .mypy_cache .ruff_cache .hypothesis .pytest-beside .pytest-beside.log
