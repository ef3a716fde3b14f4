# Two commands for a newcomer: `make run` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch keeps installs small and CI fast. GPU users:
#   make TORCH_SPEC="torch" run     (or install CUDA torch into .venv yourself first)
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
# The tests that depend on the C kernels' build or the CPU's features, which test-isas runs
# again under each other build this CPU can run (SPECDEC_ISA) and with no C compiler on PATH.
# Left out there: the comparison of all builds (it builds them all itself) and the helper's
# stress test (the same C in every build), which the main run keeps.
KERNEL_TESTS := tests/test_native.py tests/test_int4_cpu.py tests/test_layers_cpu.py tests/test_helper_cpu.py \
	tests/test_draft_bulk.py tests/test_gguf_blocks.py tests/test_gguf_repacked.py \
	tests/test_gguf_native.py
KERNEL_TESTS_ONCE := -k "not every_build_this_cpu_runs and not back_to_back_ops"

.PHONY: run test test-isas test-parity lint venv bundle clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/specdec chat

test: $(STAMP)
	$(VENV)/bin/ruff check specdec_core app tests
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy
	QT_QPA_PLATFORM=offscreen $(PY) -m pytest -q -p no:cacheprovider
	$(MAKE) test-isas

# The best build ran above (SPECDEC_ISA unset); here the others, then none.
test-isas: $(STAMP)
	set -- $$($(PY) -m specdec_core.kernels.cpu.features --runnable-isas); shift; \
	for isa in "$$@"; do \
		echo "SPECDEC_ISA=$$isa"; \
		SPECDEC_ISA=$$isa QT_QPA_PLATFORM=offscreen $(PY) -m pytest -q -p no:cacheprovider $(KERNEL_TESTS_ONCE) \
			$(KERNEL_TESTS) || exit 1; \
	done
	@echo "no C compiler on PATH"
	PATH="$$($(PY) scripts/path-without-cc build/no-cc)" env -u CC QT_QPA_PLATFORM=offscreen \
		$(PY) -m pytest -q -p no:cacheprovider $(KERNEL_TESTS_ONCE) $(KERNEL_TESTS)

# A GGUF run as stored against llama.cpp itself, the oracle of what the file means
# (tests/test_llama_parity.py), with llama.cpp built first if needed. Its build without AMX:
# the parity needs ggml's plain CPU kernels, not its speed, and that build runs on every CPU,
# also those that report AMX but trap on its instructions. The suite is told where the build
# is, so it runs instead of skipping.
test-parity: $(STAMP)
	paths="$$(PYTHON=$(PY) scripts/build-llama-cpp --no-amx)" && \
	SPECDEC_LLAMA_CPP_BIN="$$(dirname "$$(echo "$$paths" | head -n1)")" QT_QPA_PLATFORM=offscreen \
		$(PY) -m pytest -q -p no:cacheprovider -rsx tests/test_llama_parity.py tests/test_llama_cpp_served.py

lint: $(STAMP)
	$(VENV)/bin/ruff check specdec_core app tests
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

# The standalone one-folder app, dist/specdec-chat/ (packaging/README.md). Rebuilt when a
# source it carries changes. A fixed PYTHONHASHSEED is PyInstaller's advice for repeatable builds.
BUNDLE := dist/specdec-chat/specdec-chat
BUNDLE_STAMP := $(VENV)/.bundle-installed
BUNDLE_INPUTS := packaging/specdec.spec packaging/launcher.py $(wildcard app/*.py specdec_core/*.py specdec_core/*/*.py specdec_core/*/*.[ch] specdec_core/tools/bench/*.py resources/*)

$(BUNDLE_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e ".[bundle]"
	touch $(BUNDLE_STAMP)

$(BUNDLE): $(BUNDLE_STAMP) $(BUNDLE_INPUTS)
	PYTHONHASHSEED=0 $(VENV)/bin/pyinstaller --noconfirm --clean --log-level WARN \
		--distpath dist --workpath build/pyinstaller packaging/specdec.spec
	touch $(BUNDLE)

bundle: $(BUNDLE)

clean:
	rm -rf $(VENV) build dist *.egg-info
