# `make train` and `make test` work on a fresh machine with only python3, make and git.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
ARGS ?=
# jax for CUDA where nvidia-smi lists GPUs (the cuda12 extra), for CPUs elsewhere.
EXTRAS := dev$(shell nvidia-smi -L >/dev/null 2>&1 && echo ,cuda12)

.PHONY: train test test-fast lint bench clean-runs gpu-plugin

# Re-install only when pyproject.toml or constraints.txt changes. constraints.txt: the versions CI tests.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip  # measured: the install took 1.1 min after it, 3.2 min with the bundled pip 23
	$(PY) -m pip install -q -c constraints.txt -e '.[$(EXTRAS)]'
	@# Bytecode for every installed module, once. Where PYTHONDONTWRITEBYTECODE is set (this machine
	@# and CI set it) pip writes none, and every Python process compiled ~1,000 modules from source:
	@# importing the trainer took 2.45 s of CPU, 0.97 s with the bytecode (measured), in each of the
	@# hundreds of processes the tests start. Files for other Pythons (torch's py312 tests) are skipped.
	$(PY) -c 'import compileall, sysconfig; compileall.compile_dir(sysconfig.get_paths()["purelib"], quiet=2, workers=0)'
	touch $(STAMP)

# The CUDA plugin of the installed jax, for compiling the GPU program without a GPU (scripts/plan.py,
# tests/test_gpu_compile.py). It lives outside the repo, once per user and jax version (~3.2 GB
# downloaded, 4.9 GB on disk): a fresh clone reuses it. CPU runs and the CPU tests never load it;
# only code that puts it on sys.path does (jaxtrain/plan/targets.py: use_plugin, plugin_dir).
gpu-plugin: $(STAMP)
	@d=$$($(PY) -c 'from jaxtrain.plan.targets import plugin_dir; print(plugin_dir())'); \
	if [ ! -f "$$d/.complete" ]; then \
	  v=$$($(PY) -c 'import importlib.metadata as m; print(m.version("jax"))'); \
	  echo "installing the CUDA plugin of jax $$v into $$d (~3.2 GB, once)"; \
	  rm -rf "$$d.partial" && \
	  $(PY) -m pip install -q --target "$$d.partial" "jax-cuda12-plugin[with-cuda]==$$v" "jax-cuda12-pjrt==$$v" && \
	  rm -rf "$$d" && mv "$$d.partial" "$$d" && touch "$$d/.complete"; \
	else \
	  echo "the CUDA plugin is installed: $$d"; \
	fi

train: $(STAMP)
	$(PY) scripts/train.py --config configs/default.yaml $(ARGS)

# All tests. The CPU suite runs in two pytest-xdist workers (most tests wait on processes they
# started; files that share a machine-wide resource stay on one worker: tests/conftest.py). The
# GPU program's compile tests (tests/test_gpu_compile.py) need the CUDA plugin: they install it
# and run in a process of their own beside the CPU suite, niced so that they take only the CPU the
# suite leaves idle (both must pass; without the plugin they fail, never skip). With ARGS: pytest
# ARGS alone.
# Bytecode for our own modules once: where PYTHONDONTWRITEBYTECODE is set (this CI machine sets it),
# every process the tests start would compile jaxtrain from source again (1.55 -> 1.36 s of CPU to
# import the trainer, hundreds of processes). Stale files are ignored by Python, never wrong.
test: $(STAMP)
	@$(PY) -m compileall -q jaxtrain scripts tests bench > /dev/null; \
	if [ -n "$(ARGS)" ]; then exec $(PY) -m pytest -q $(ARGS); fi; \
	( $(MAKE) -s gpu-plugin && nice -n 19 $(PY) -m pytest -q -p no:cacheprovider tests/test_gpu_compile.py ) \
	  > .gpu-tests.log 2>&1 & gpu=$$!; \
	$(PY) -m pytest -q -n 2 --dist loadgroup --ignore=tests/test_gpu_compile.py; cpu=$$?; \
	wait $$gpu; gpu_rc=$$?; echo "--- tests/test_gpu_compile.py (with make gpu-plugin):"; cat .gpu-tests.log; \
	[ $$cpu -eq 0 ] && [ $$gpu_rc -eq 0 ]

# The fast tier, for your own edit-and-test loop (make test before a commit): under 5 min on this
# 2-core machine (4.8 min measured with other engineers' tests beside it; about 4 min of CPU). The
# config, data, plan, failure and checkpoint tests, the docs' commands, the layout, the train step;
# not the slow, multi-process, SLURM or namespace tests, nor the model's compile-heavy files (run
# those by name: make test ARGS=tests/test_model.py).
FAST := config layout plan plan_forecast advice cluster docs data versions xla_env prepare make \
	checkpoint_damage runlock bad_input resolve run step train_script
test-fast: $(STAMP)
	@$(PY) -m compileall -q jaxtrain scripts tests bench > /dev/null
	$(PY) -m pytest -q -n 2 --dist loadgroup -m 'not slow and not multiprocess and not slurm and not multihost' \
	  $(patsubst %,tests/test_%.py,$(FAST)) $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check jaxtrain scripts tests bench
	$(VENV)/bin/ruff format --check jaxtrain scripts tests bench
	$(VENV)/bin/mypy jaxtrain

bench: $(STAMP)
	$(PY) bench/bench_loop.py $(ARGS)
