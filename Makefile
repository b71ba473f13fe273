# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv.
PYTHON ?= python3
# The default leg's pins (matrix/legs.py): make test runs on exactly that stack.
PINS := $(shell $(PYTHON) -m matrix pins default)
TORCH ?= $(filter torch==%,$(PINS))
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

# The test-fixture backend (tests/plugins/example_backend) is not one of them: the tests that
# need it install it for their run only (the example_backend fixture, tests/conftest.py).
PACKAGES := -e packages/core -e packages/backend-fs -e packages/strategy-fsdp2 -e packages/demo \
            -e packages/integration-roll -e packages/integration-torchtitan -e packages/integration-verl -e ".[all,dev]"
SOURCES := pyproject.toml packages/*/pyproject.toml matrix/legs.py

.PHONY: venv demo test test-leg leg-venv test-matrix test-reliability bench bench-check bench-peers bench-leg bench-torchtitan docs wheels clean

venv: $(STAMP)

# pip byte-compiles what it installs on one core; compileall does it afterwards on every core
# (10-14 s less here, side by side). A file that does not compile is skipped, as pip skips it.
$(STAMP): $(SOURCES) Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q --no-compile "$(TORCH)"
	$(PIP) install -q --no-compile "$(TORCH)" $(filter-out torch==%,$(PINS)) $(PACKAGES)
	$(PIP) uninstall -qq -y roll-ckpt-example-backend  # left by an older set-up; a no-op otherwise
	$(PY) -m compileall -q -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" > /dev/null || true
	touch $(STAMP)

demo: venv
	$(VENV)/bin/roll-ckpt demo --config examples/rlvr_demo.yaml --output output/demo --fresh --stop-after 30
	$(VENV)/bin/roll-ckpt demo --config examples/rlvr_demo.yaml --output output/demo --resume

# The suite on TEST_WORKERS processes (pytest-xdist): most tests wait on processes they
# started (ranks, servers), so two workers keep a 2-core machine busy. TEST_WORKERS=0 runs
# it in one process. worksteal: xdist hands each worker a contiguous share at first, and the
# longest modules come first (tests/conftest.py), so an idle worker takes from the other's.
TEST_WORKERS ?= 2
TEST_DIST := $(if $(filter 0,$(TEST_WORKERS)),,--dist worksteal)
# ROLL_CKPT_TEST_LEG: the suite checks it runs on that leg's pins (not when TORCH is another).
test: venv
	ROLL_CKPT_TEST_LEG=$(if $(filter $(TORCH),$(PINS)),default,) $(PY) -m pytest -q -n $(TEST_WORKERS) $(TEST_DIST) $(PYTEST_ARGS)

# The compatibility matrix (matrix/legs.py): one venv per leg in .matrix/<leg>/ (pip, the leg's
# pins, the project editable), the whole suite in each; the cross-version tests in every leg
# resume every other built leg's checkpoints. test-matrix records each leg's counts and time in
# matrix/results/ and docs/compatibility.md; test-leg runs one (LEG=roll-2.8), leg-venv builds one.
LEG ?= roll-2.8
leg-venv:
	$(PYTHON) -m matrix build $(LEG)

test-leg:
	$(PYTHON) -m matrix test $(LEG) --workers $(TEST_WORKERS)

test-matrix:
	$(PYTHON) -m matrix test --all --record --workers $(TEST_WORKERS)

# Crash consistency and fault injection at full strength: 50 SIGKILLs per mode (make test
# runs 5), the kill-before-every-storage-operation sweep on S3 too, a rank stopped in each phase
# of a resume as well as of a save (tests/reliability/test_hangs.py). Replay a failure with
# ROLL_CKPT_CRASH_SEED=<seed printed by the test>.
RELIABILITY_KILLS ?= 50
RELIABILITY_SOAK_SAVES ?= 40
test-reliability: venv
	ROLL_CKPT_KILLS=$(RELIABILITY_KILLS) ROLL_CKPT_SOAK_SAVES=$(RELIABILITY_SOAK_SAVES) $(PY) -m pytest -q -n $(TEST_WORKERS) $(TEST_DIST) tests/reliability tests/backend_fs/test_network_faults.py $(PYTEST_ARGS)

# Benchmark: stall, memory and throughput against DCP, torch.save, the peer libraries and the
# disk, in one run (--quick; BENCH_ARGS=--full for larger states). Writes
# bench/results/latest.{json,md,png}; bench-check exits non-zero when a target fails.
# The package bench/ (python -m bench.<name> for the others: scale, recovery, soak, ...).
BENCH_ARGS ?= --quick
bench: venv bench-peers
	$(BENCH_PY) -m bench $(BENCH_ARGS)

bench-check: venv bench-peers
	$(BENCH_PY) -m bench --check $(BENCH_ARGS)

# The peer libraries the benchmark measures beside roll-ckpt (bench/peers.py). They are not
# dependencies of roll-ckpt or of its tests, so they go into the benchmark's own venv,
# .venv-bench, which sees .venv's packages beneath its own (a .pth file that adds .venv's
# site-packages: torch and roll-ckpt are not installed twice). ByteCheckpoint declares
# torch<=2.5 and pins protobuf 3.20, older than Ray's in .venv: it is installed without its
# dependencies, which are named here from its metadata (torch left out).
BENCH_VENV := .venv-bench
BENCH_PY := $(BENCH_VENV)/bin/python
BENCH_STAMP := $(BENCH_VENV)/.installed
PEERS := torch-checkpointing==0.1.1
PEERS_NO_DEPS := bytecheckpoint==0.0.2
PEERS_DEPS := grpcio==1.69.0 protobuf==3.20.3 "mmh3>=4.1.0,<=4.2.0" "universal-pathlib>=0.2.2,<=1.0.0" \
              "cachetools>=5.4.0,<=10.0.0"
bench-peers: $(BENCH_STAMP)

$(BENCH_STAMP): $(STAMP) Makefile
	test -x $(BENCH_PY) || $(PYTHON) -m venv $(BENCH_VENV)
	echo "import site; site.addsitedir('$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')')" \
	  > "$$($(BENCH_PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/roll_ckpt_venv.pth"
	$(BENCH_PY) -m pip install -q --upgrade pip
	$(BENCH_PY) -m pip install -q --no-compile $(PEERS) $(PEERS_DEPS)
	$(BENCH_PY) -m pip install -q --no-compile --no-deps $(PEERS_NO_DEPS)
	$(BENCH_PY) -c 'import bench.peers as p, sys; bad = {k: c().why_not() for k, c in p.PEERS.items()}; \
	  [print(k, why) for k, why in bad.items() if why]; sys.exit(any(bad.values()))'
	touch $(BENCH_STAMP)

# The same benchmark in one leg's venv (LEG=roll-2.8: ROLL's torch 2.8 stack), built first if
# missing; into bench/results/<leg>/ (docs/benchmark.md compares it with the default leg's).
bench-leg:
	test -x .matrix/$(LEG)/bin/python || $(PYTHON) -m matrix build $(LEG)
	.matrix/$(LEG)/bin/python -m bench $(BENCH_ARGS) --out bench/results/$(LEG)

# The group torchtitan of the benchmark (T18): torchtitan's own checkpoint manager with its
# default async_mode: async against roll-ckpt's, on the same model and 2 ranks, in the torchtitan
# leg's venv (built first if missing); into bench/results/torchtitan.{json,md}.
bench-torchtitan:
	test -x .matrix/torchtitan/bin/python || $(PYTHON) -m matrix build torchtitan
	.matrix/torchtitan/bin/python -m bench.torchtitan --out bench/results

# The documentation site (mkdocs.yml, docs/) into site/, warnings as errors. Its configuration,
# command-line and API references are generated from the code at build time (docs/_hooks/).
docs: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# Pure-Python wheels of the eight distributions and of the two the core needs that a GPU
# machine's Python may lack (omegaconf and its parser), carried there by scripts/gpu_check.sh.
wheels: venv
	rm -rf dist && $(PIP) wheel -q --no-deps -w dist . packages/core packages/backend-fs packages/strategy-fsdp2 packages/demo packages/integration-roll packages/integration-torchtitan packages/integration-verl
	$(PIP) wheel -q --no-deps -w dist "omegaconf==$$($(PY) -c 'import omegaconf; print(omegaconf.__version__)')" "antlr4-python3-runtime==4.9.3"

clean:
	rm -rf $(VENV) $(BENCH_VENV) .matrix output .pytest_cache site
