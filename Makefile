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
	$(BIN)/python -c 'from ftlayer.core.rangeacks import compile_kernels; compile_kernels()'
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

# The suite mostly waits (Spark's micro-batches, the outages and timeouts the tests
# stage), so `unit` runs it as three pytest processes side by side, each with its own
# broker, Spark session, FT-layer servers and base temp dir, balanced by measured
# duration (`make unit DURATIONS=0` prints every test's; move whole files between the
# lists). BESIDE: the kill and restart tests of Kafka and of receivers, the demos, the
# deploy guide's packed environment on a standalone cluster. SECOND: the cluster on hosts
# of network namespaces, the shard outage, savepoint and rewind, the FT layer's outages
# under a query, slow batches, loops, offset commits and the longest Spark pipelines. The main run is everything else (a new test
# file lands there). The main run's output comes first, then SECOND's
# (.pytest-second.log), then BESIDE's (.pytest-beside.log); `unit` fails if any run does.
BESIDE := tests/integration/test_recovery_kills.py tests/integration/test_demo.py \
	tests/integration/test_ingest_kills.py tests/integration/test_packed_env.py
SECOND := tests/integration/test_cluster_hosts.py tests/integration/test_shard_outage.py \
	tests/integration/test_savepoint_shards.py tests/integration/test_shard_rewind.py \
	tests/integration/test_server_restarts.py tests/integration/test_slow_batches.py \
	tests/integration/test_flow_control.py tests/integration/test_user_guide.py \
	tests/integration/test_barrier_pipelines.py tests/integration/test_held_sink_acks.py \
	tests/integration/test_pipeline.py tests/integration/test_loops.py \
	tests/integration/test_offset_commits.py
DURATIONS ?= 25
# Spark's JVMs start from a class-data archive of what a warm-up session loaded
# (tests/jvm_cds.py): about 40% less CPU per JVM started, on a suite that starts dozens.
# Made once per environment; a JVM that cannot use it starts without it.
JVM_CLASSES := .jvm-classes.jsa
$(JVM_CLASSES): $(STAMP) tests/jvm_cds.py
	rm -f $@
	JAVA_TOOL_OPTIONS="-XX:ArchiveClassesAtExit=$(CURDIR)/$@ -Xlog:cds*=off" \
		$(BIN)/python tests/jvm_cds.py
# Every Python process the suite starts (FT-layer servers, Spark's Python workers and
# source runners, the CLI) imports ftlayer: its bytecode is compiled here, once, so that
# none compiles it again (with PYTHONDONTWRITEBYTECODE set none would write it; about
# 0.4 s of CPU per server start).
unit: $(STAMP) $(JVM_CLASSES)
	$(BIN)/python -m compileall -q -j 0 ftlayer persistence partitioners integration tests
	@export JAVA_TOOL_OPTIONS="-XX:SharedArchiveFile=$(CURDIR)/$(JVM_CLASSES) -Xlog:cds*=off"; \
	$(BIN)/pytest -q -p no:cacheprovider --durations=$(DURATIONS) --basetemp=.pytest-beside \
		$(BESIDE) > .pytest-beside.log 2>&1 & beside=$$!; \
	$(BIN)/pytest -q -p no:cacheprovider --durations=$(DURATIONS) --basetemp=.pytest-second \
		$(SECOND) > .pytest-second.log 2>&1 & second=$$!; \
	$(BIN)/pytest -q --durations=$(DURATIONS) --basetemp=.pytest-main \
		$(foreach f,$(BESIDE) $(SECOND),--ignore=$(f)); main=$$?; \
	wait $$second; other=$$?; \
	echo "---- SECOND, run beside the main run: $(SECOND)"; cat .pytest-second.log; \
	wait $$beside; beside=$$?; \
	echo "---- BESIDE, run beside the main run: $(BESIDE)"; cat .pytest-beside.log; \
	echo "---- main run: exit $$main; SECOND: exit $$other; BESIDE: exit $$beside"; \
	exit $$(( main != 0 || other != 0 || beside != 0 ))

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
	rm -rf $(VENV) .typecheck .pytest_cache .mypy_cache .ruff_cache .hypothesis \
		.pytest-main .pytest-second .pytest-second.log .pytest-beside .pytest-beside.log
