# Two commands do all the set-up on a fresh machine:
#   make demo   - the main job: LoRA-trains a small LM through the backend (CPU when there is no GPU)
#   make test   - the test suite (what .ci/run calls)
# Options go in ARGS: make demo ARGS="--steps 100", make test ARGS="-k cli".
# The tests run in TEST_WORKERS processes (pytest-xdist, a test file per process; 2 by default, as CI's machine
# has 2 cores: 15 minutes there instead of 29); TEST_WORKERS=0 runs them in this process.
# Both create .venv on first use. torch is installed FIRST, pinned, so that a machine
# without a GPU never pulls the multi-GB CUDA build: there it gets the CPU wheel.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
ARGS ?=
TEST_WORKERS ?= 2

.PHONY: demo test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
ifeq ($(HAS_GPU),yes)
	$(PY) -m pip install -q "torch>=2.11"
else
	$(PY) -m pip install -q "torch==2.13.0+cpu" || $(PY) -m pip install -q --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"
endif
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/stagehand demo $(ARGS)

test: $(VENV)/.installed
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile $(ARGS)

clean:
	rm -rf $(VENV) stagehand-demo-out

# Regenerate the figures README.md and docs/ quote from benches/results/ (the check: python benches/figures.py).
.PHONY: figures
figures: $(VENV)/.installed
	$(PY) benches/figures.py --write
