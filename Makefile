# `make train` and `make test` work on a fresh machine: each installs what it needs first.
# GPU users: make install TORCH="torch==2.13.0 --index-url <your CUDA wheel index>"
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# a CUDA build of the same torch, for the tests that run the step on fake CUDA tensors
# (tests/test_cuda_semantics.py; no GPU needed): --isolated skips a local CPU-only wheel
CUDA_VENV ?= .venv-cuda
CUDA_STAMP := $(CUDA_VENV)/.installed
TRAIN_ARGS ?=

.PHONY: install train test test-fast gpu-check clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

$(CUDA_STAMP): pyproject.toml
	$(PYTHON) -m venv $(CUDA_VENV)
	for try in 1 2 3; do $(CUDA_VENV)/bin/pip install --isolated -q $(TORCH) numpy pyyaml tqdm safetensors && break; sleep 10; done
	$(CUDA_VENV)/bin/pip install --isolated -q --no-deps "torchao>=0.18"
	$(CUDA_VENV)/bin/pip install --isolated -q "pytest>=7.4"
	$(CUDA_VENV)/bin/python -c "import torch; assert torch.backends.cuda.is_built(), torch.__version__"
	touch $(CUDA_STAMP)

install: $(STAMP)

train: $(STAMP)
	$(PY) -m gridtrain train --config configs/small.yaml $(TRAIN_ARGS)

test: $(STAMP) $(CUDA_STAMP)
	GRIDTRAIN_CUDA_PYTHON=$(abspath $(CUDA_VENV))/bin/python $(PY) -m pytest -q

# the tests that start no process and take no more than a second or two (under a minute)
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not spawn and not slow"

# The GPU self-check (docs/gpus.md): the machine's own python3 and torch, no venv, no
# install, no network; refuses in one line (exit 2) where no CUDA GPU is visible.
GPU_CHECK_OUT ?= gpu-check/$(shell date +%Y-%m-%d-%H%M)
gpu-check:
	@PYTHONPATH=$(CURDIR) $(PYTHON) -m gridtrain.selfcheck --gpu --out $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) $(CUDA_VENV) runs .pytest_cache
