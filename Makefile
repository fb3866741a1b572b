# grpod: `make demo` runs the embedded default campaign, `make test` runs the whole suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU machines take the local CPU wheel; GPU nodes install torch themselves (pyproject: torch>=2.4).
TORCH_PIN ?= torch==2.13.0
TOOLS := .tools
PROMTOOL := $(TOOLS)/promtool
# Outside the clone: as root the server runs as `postgres`, which cannot enter a 0700 home
# or mktemp -d; one data directory per port, removed by `make postgres-stop`.
PGDATA ?= /tmp/grpod-pgtest-$(PGPORT)
PGPORT ?= 55432

.PHONY: venv demo test lint fmt promtool postgres postgres-stop clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

demo: venv
	$(BIN)/grpod run --max-steps 40

test: venv promtool postgres
	PATH=$(CURDIR)/$(TOOLS):$$PATH GRPOD_TEST_PG_URL=postgresql+psycopg://grpod@127.0.0.1:$(PGPORT)/grpod \
		$(BIN)/python -m pytest

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

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
	rm -rf $(VENV) $(TOOLS) var
