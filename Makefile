# Entry points; the README's first lines name `make demo` and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
TINY   := models/tiny
MODELS := models/default
PROMPT ?= def fibonacci(n):

.PHONY: install demo local test tiny clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/install.sh
	VENV=$(VENV) scripts/install.sh
	touch $@

$(TINY)/target/config.json: | install
	$(PY) -m common.make_tiny --out $(TINY) --seed 0

tiny: $(TINY)/target/config.json

# Both services on localhost plus a client; stops both afterwards.
demo: install
	$(PY) scripts/demo.py --target $(MODELS)/target --draft $(MODELS)/draft --prompt "$(PROMPT)" --max-new-tokens 96

# The same generation in one process, without the network.
local: install
	$(PY) -m drafter_svc.generate --target $(MODELS)/target --draft $(MODELS)/draft \
		--prompt "$(PROMPT)" --max-new-tokens 96 --tree-budget 15

# The tests run in TEST_WORKERS processes (default: one per usable core, at most 8), a test file
# to each, and torch on one thread in each: the tiny models gain little from a second thread,
# and the workers (and the servers some tests start) then do not contend for the cores.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ "$$n" -gt 8 ] && n=8; echo $$n)

test: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

clean:
	rm -rf $(TINY) .pytest_cache
