# Every target creates .venv when missing; nothing else is needed on a fresh machine.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Python's own default, also where the environment turns it off: the suites start hundreds of
# interpreters, and each would compile torchport's and the tests' sources again (__pycache__
# folders are ignored by git and by every check of the source tree).
export PYTHONDONTWRITEBYTECODE :=

.PHONY: demo test test-torch test-graph test-opencl test-vendor conformance compiled-conformance examples zoo quant stress fuzz bench lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test,opencl]'  # opencl: pyopencl + PoCL wheels
	$(BIN)/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	$(BIN)/python -c "from torchport.core import native; native.load()"  # views, device guard
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/train_cnn.py

# Stages, chosen by pytest markers (pyproject.toml; which module has which, and what runs in
# which long target instead: tests/README.md). Three process slots side by side on 2 cores,
# each pytest with one intra-op thread (three processes already fill the cores):
# 1. the suite on default (host-addressable) sim memory, less the porting tools (`tools`),
#    torch.compile (`graph`), the real-scripts subset (`scripts`), OpenCL and DEFAULT_LATER;
#    then DEFAULT_AFTER (the zoo's quick cases);
# 2. the modules marked `modes` (core tests, the op layer's, the conformance subsets, the
#    device layer's) with device-only memory (TORCHPORT_SIM_STRICT=1), where every byte must
#    go through the runtime, plus those marked `strict` (the real-scripts subset runs there
#    only) and `opencl` but not `opencl_full` (the OpenCL backend's subset on PoCL, in a
#    worker process of its own; `make test-opencl` runs all of it); then DEFAULT_LATER;
# 3. the `modes` modules with asynchronous streams (TORCHPORT_SIM_ASYNC=1), plus those marked
#    `asynchronous` (streams, migrated examples); then, in default mode, the porting tools'
#    tests (mostly subprocesses) and torch.compile's (compiling takes seconds), less the
#    clean install (`make test-torch` runs it).
# No slot runs `slow` tests: the long targets that run their modules do (make stress, make
# test-graph, make test-opencl, make conformance, ...). The logs of slots 2 and 3 are
# printed when all ended, then each stage's wall time.
# DEFAULT_LATER: default-mode modules of worker processes (c10d, DDP, FSDP2, the vendor
# backends in child interpreters, Lightning, the fuzzer's runs), moved out of slots 1 and 3
# so that the slots end together.
MODE_PYTEST := OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider
DEFAULT_LATER := tests/test_distributed.py tests/test_distributed_parallel.py \
	tests/test_distributed_bound_device.py tests/test_vendor_walkthrough.py \
	tests/test_vendor_reference.py tests/test_vendor_recipe.py tests/test_vendor_mutations.py \
	tests/test_vendor_stream_order.py tests/test_vendor_kernel_contract.py \
	tests/test_integrations_lightning.py tests/test_fuzz.py
# DEFAULT_AFTER: porting tools' modules run in slot 1 after the default stage (slot 3 leaves
# them out), so that the slots end together.
DEFAULT_AFTER := tests/test_zoo.py
test: $(STAMP)
	logs=$$(mktemp -d); rc=0; t0=$$(date +%s); since() { echo $$(( $$(date +%s) - t0 )); }; \
	( TORCHPORT_SIM_STRICT=1 $(MODE_PYTEST) -m "(modes or strict or (opencl and not opencl_full)) and not slow" \
		tests > $$logs/strict 2>&1; src=$$?; since > $$logs/strict.s; \
	  $(MODE_PYTEST) -m "not slow" $(DEFAULT_LATER) > $$logs/later 2>&1 || src=1; since > $$logs/later.s; \
	  exit $$src ) & strict=$$!; \
	( TORCHPORT_SIM_ASYNC=1 $(MODE_PYTEST) -m "(modes or asynchronous) and not slow" tests \
		> $$logs/async 2>&1; arc=$$?; since > $$logs/async.s; \
	  $(MODE_PYTEST) -m "(tools or graph) and not opencl and not asynchronous and not slow" \
		--ignore=tests/test_clean_install.py $(addprefix --ignore=,$(DEFAULT_LATER) $(DEFAULT_AFTER)) \
		tests > $$logs/tools 2>&1 || arc=1; \
	  since > $$logs/tools.s; exit $$arc ) & async=$$!; \
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q --durations=15 \
		-m "not tools and not graph and not scripts and not opencl and not slow" \
		$(addprefix --ignore=,$(DEFAULT_LATER)) tests || rc=1; since > $$logs/default.s; \
	echo "== porting tools after the default stage (default mode)"; \
	$(MODE_PYTEST) -m "not slow" $(DEFAULT_AFTER) || rc=1; since > $$logs/after.s; \
	wait $$strict || rc=1; wait $$async || rc=1; \
	echo "== porting tools and torch.compile (default mode)"; cat $$logs/tools; \
	echo "== TORCHPORT_SIM_STRICT=1"; cat $$logs/strict; \
	echo "== worker-process modules (default mode, after the strict stage)"; cat $$logs/later; \
	echo "== TORCHPORT_SIM_ASYNC=1"; cat $$logs/async; \
	s=$$(cat $$logs/strict.s); a=$$(cat $$logs/async.s); \
	echo "== stage wall times, the three slots side by side:"; \
	echo "== default stage: $$(cat $$logs/default.s) s, then porting tools: $$(( $$(cat $$logs/after.s) - $$(cat $$logs/default.s) )) s"; \
	echo "== strict stage: $$s s, then worker-process modules: $$(( $$(cat $$logs/later.s) - s )) s"; \
	echo "== async stage: $$a s, then tools and torch.compile: $$(( $$(cat $$logs/tools.s) - a )) s"; \
	echo "== total: $$(since) s"; rm -rf $$logs; exit $$rc

# The suite's representative subset on another torch release (docs/compatibility.md):
# make test-torch TORCH=2.14.1 (or 2.15.0; PY=python3.12 for another interpreter) builds
# .venv-torch-$(TORCH) (torch==$(TORCH) first, from the registry's default build, a CUDA
# one on Linux; the project and its test extra after it, under a constraint that keeps that
# torch), then runs TORCH_TESTS in default sim memory and beside it TORCH_STRICT_TESTS (the
# copies, fallback, op layer, guard and streams) with device-only memory, then the clean
# install (tests/test_clean_install.py). About 10 minutes on 2 cores. The constraint file stands
# in for the machine's pip constraint (PIP_CONSTRAINT) in that venv only, so a release the
# machine's constraint caps (2.15.0 here) can be had.
TORCH ?= 2.14.1
TORCH_VENV ?= .venv-torch-$(TORCH)$(if $(filter python3.11,$(PY)),,-$(notdir $(PY)))
TORCH_BIN := $(TORCH_VENV)/bin
TORCH_PIP := PIP_CONSTRAINT=$(CURDIR)/$(TORCH_VENV)/constraints.txt $(TORCH_BIN)/python -m pip
# The default stage less its longest modules that exercise torchport's own logic rather
# than what a torch release changes (the OpInfo/layout conformance subsets, the threaded
# reliability runs, FSDP2/SyncBatchNorm, the Hugging Face models); then the clean install.
TORCH_TESTS ?= -m "not tools and not graph and not scripts and not opencl" tests \
	--ignore=tests/conformance --ignore=tests/test_reliability_async.py \
	--ignore=tests/test_reliability_allocator.py --ignore=tests/test_distributed_parallel.py \
	--ignore=tests/test_models_hf.py
TORCH_STRICT_TESTS ?= tests/test_core_copies.py tests/test_core_fallback.py \
	tests/test_ops_layer.py tests/test_device_guard.py tests/test_streams.py
$(TORCH_VENV)/.installed: pyproject.toml
	test -x $(TORCH_BIN)/python || $(PY) -m venv $(TORCH_VENV)
	echo "torch==$(TORCH)" > $(TORCH_VENV)/constraints.txt
	$(TORCH_PIP) install -q --upgrade pip
	$(TORCH_PIP) install -q torch==$(TORCH)
	$(TORCH_PIP) install -q -e '.[test]'
	$(TORCH_BIN)/python -c "import torch; assert torch.__version__.split('+')[0] == '$(TORCH)', torch.__version__"
	$(TORCH_BIN)/python -c "from torchport.core import native; native.load()"
	touch $@

test-torch: $(TORCH_VENV)/.installed
	$(TORCH_BIN)/python -c "import sys, torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'Python', sys.version.split()[0])"
	log=$$(mktemp); rc=0; \
	TORCHPORT_SIM_STRICT=1 OMP_NUM_THREADS=1 $(TORCH_BIN)/python -m pytest -q \
		-p no:cacheprovider $(TORCH_STRICT_TESTS) > $$log 2>&1 & strict=$$!; \
	OMP_NUM_THREADS=1 $(TORCH_BIN)/python -m pytest -q -p no:cacheprovider $(TORCH_TESTS) || rc=1; \
	wait $$strict || rc=1; echo "== TORCHPORT_SIM_STRICT=1"; cat $$log; rm -f $$log; \
	echo "== clean install"; \
	OMP_NUM_THREADS=1 $(TORCH_BIN)/python -m pytest -q -p no:cacheprovider \
		tests/test_clean_install.py || rc=1; \
	exit $$rc

# The OpenCL backend's whole suite on PoCL (make test runs its representative subset: device
# memory, copies, a model training, fallback, streams, errors; this adds the kernel sweeps,
# the transformer block and the conformance subset: a few minutes on 2 cores), then PyTorch's
# device-generic test files of ../shared/upstream/ on ocl where that folder exists (about an
# hour and a half).
test-opencl: $(STAMP)
	rc=0; \
	$(BIN)/python -m pytest -q -m opencl tests || rc=1; \
	if [ -f ../shared/upstream/run_upstream.sh ]; then \
		OMP_NUM_THREADS=1 UPSTREAM_FILE_TIMEOUT=5400 UPSTREAM_DEVICE_UNDER_TEST=ocl \
			UPSTREAM_BACKEND=torchport.opencl bash ../shared/upstream/run_upstream.sh || rc=1; \
	fi; \
	exit $$rc

# torch.compile on the sim, all of it (make test runs it without the Hugging Face model's
# compiled training, minutes of compiling on 2 cores).
test-graph: $(STAMP)
	TORCHPORT_FULL_MODELS=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m graph tests

# The reference backend (torchport.backends.reference, device ref: device-only memory, a
# worker thread per stream, numpy kernels) through the long suites: every OpInfo
# (reports/conformance-ref.{json,md}), its own tests, the written-arguments sweep over every
# in-place and out= OpInfo on it, on the walkthrough and with no kernels at all
# (tests/mutation_sweep.py --op-db), module_db (reports/modules-ref.{json,md}), the 29
# Hugging Face architectures and the Lightning tests (TORCHPORT_TEST_BACKEND, under pytest
# --noconftest: one backend per process), the zoo's nanoGPT and Lightning cases (eager),
# 300 fuzz programs compared within tolerance, and PyTorch's device-generic test files where
# ../shared/upstream has them. All runs always execute.
test-vendor: $(STAMP)
	rc=0; ref=torchport.backends.reference; \
	$(BIN)/python -m torchport.tools.conformance --backend $$ref \
		$(CONFORMANCE_ARGS) --name conformance-ref || rc=1; \
	$(BIN)/python -m tests.conformance.modules --backend $$ref $(MODULES_ARGS) || rc=1; \
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q tests/test_vendor_reference.py \
		tests/test_vendor_mutations.py tests/test_vendor_stream_order.py \
		tests/test_vendor_ref_suites.py || rc=1; \
	TORCHPORT_TEST_BACKEND=$$ref TORCHPORT_FULL_MODELS=1 OMP_NUM_THREADS=1 \
		$(BIN)/python -m pytest --noconftest -q tests/test_models_hf.py \
		tests/test_integrations_lightning.py || rc=1; \
	TORCHPORT_TEST_BACKEND=$$ref TORCHPORT_FULL_ZOO=1 OMP_NUM_THREADS=1 \
		$(BIN)/python -m pytest -q tests/test_zoo.py -k '(nanogpt or lightning) and not compile' || rc=1; \
	OMP_NUM_THREADS=1 $(BIN)/python -m torchport.tools.fuzz --backend $$ref --n 300 \
		--jobs 1 --out reports/tmp/fuzz-ref --minimise || rc=1; \
	for b in bare walk torchport.backends.reference; do \
		out=$$(OMP_NUM_THREADS=1 $(BIN)/python -m tests.mutation_sweep $$b --op-db) || rc=1; \
		echo "$$out" | tail -1; ! echo "$$out" | grep MISMATCH || rc=1; \
	done; \
	if [ -f ../shared/upstream/run_upstream.sh ]; then \
		OMP_NUM_THREADS=1 UPSTREAM_FILE_TIMEOUT=5400 UPSTREAM_DEVICE_UNDER_TEST=ref \
			UPSTREAM_BACKEND=torchport.backends.reference \
			bash ../shared/upstream/run_upstream.sh || rc=1; \
	fi; \
	exit $$rc

# Every OpInfo of PyTorch's op_db, sim vs CPU (python -m torchport.tools.conformance, which a vendor
# runs with --backend against its own), in both sim memory modes, default
# (reports/conformance.{json,md}) and TORCHPORT_SIM_STRICT=1 (reports/conformance-strict.*),
# and with kernels queued on stream workers, TORCHPORT_SIM_ASYNC=1
# (reports/conformance-async.*), 3-7 minutes each on 2 cores; every ModuleInfo of
# module_db in the three modes (reports/modules*.md, about a minute each); op_db in strided
# layouts (reports/layouts.md, about 4 minutes); all 29 Hugging Face architectures in the
# three modes. All runs always execute; the target fails if any has a failure.
CONFORMANCE_ARGS ?= --full --max-samples 5 --op-timeout 120 --quiet
MODULES_ARGS ?= --max-samples 3 --quiet
conformance: $(STAMP)
	rc=0; \
	$(BIN)/python -m torchport.tools.conformance $(CONFORMANCE_ARGS) || rc=1; \
	$(BIN)/python -m torchport.tools.conformance $(CONFORMANCE_ARGS) --strict || rc=1; \
	$(BIN)/python -m torchport.tools.conformance $(CONFORMANCE_ARGS) --async || rc=1; \
	$(BIN)/python -m tests.conformance.modules $(MODULES_ARGS) || rc=1; \
	$(BIN)/python -m tests.conformance.modules $(MODULES_ARGS) --strict || rc=1; \
	$(BIN)/python -m tests.conformance.modules $(MODULES_ARGS) --async || rc=1; \
	$(BIN)/python -m tests.conformance.layouts --max-samples 4 --quiet || rc=1; \
	for mode in "" TORCHPORT_SIM_STRICT=1 TORCHPORT_SIM_ASYNC=1; do \
		env $$mode TORCHPORT_FULL_MODELS=1 $(BIN)/python -m pytest -q tests/test_models_hf.py \
			|| rc=1; \
	done; \
	exit $$rc

# torch.compile on sim against torch.compile on the CPU, every OpInfo of op_db (float32, two
# samples each; python -m torchport.tools.conformance.compiled): equal / close / both-error /
# MISMATCH per sample, each mismatch diagnosed (reports/compiled-opinfo.{md,json}). About 30
# minutes on 2 cores with a cold kernel cache. Fails on an undiagnosed mismatch.
COMPILED_ARGS ?= --quiet
compiled-conformance: $(STAMP)
	$(BIN)/python -m torchport.tools.conformance.compiled $(COMPILED_ARGS)

# Typical CUDA training scripts (examples/scripts/: torch.accelerator, .cuda() with checkpoint
# resume, mp.spawn DDP, DataParallel, Hugging Face Trainer in fp32/bf16/fp16, accelerate), each
# run unchanged (torchport run), migrated then run, and under torchport coverage, against the
# original on the CPU, mnist_hogwild's --cuda code under torchport run (tests/test_ipc.py), and
# the Trainer's migrated bf16 script (tests/test_integrations_hf_migrated.py);
# make test runs a subset. About 10 minutes on 2 cores.
examples: $(STAMP)
	TORCHPORT_FULL_SCRIPTS=1 $(BIN)/python -m pytest -q tests/test_real_scripts.py
	$(BIN)/python -m pytest -q -m slow tests/test_ipc.py tests/test_integrations_hf_migrated.py

# An optional extra goes into .venv under a constraint that keeps the venv's torch (PIP_EXTRA).
PIN := $(VENV)/torch-pin.txt
PIP_EXTRA := PIP_CONSTRAINT=$(CURDIR)/$(PIN) $(BIN)/python -m pip install -q -e
$(PIN): $(STAMP)
	$(BIN)/python -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > $@

# The zoo (examples/zoo/, docs/zoo.md): nanoGPT-style GPT (eager, compiled, bf16 autocast,
# DDP under torchrun), a diffusers UNet DDPM, peft LoRA, each run unchanged and migrated
# against the CPU, with the zoo extra; step times go to reports/zoo.jsonl. About 10 minutes
# on 2 cores.
zoo: $(PIN)
	$(PIP_EXTRA) '.[zoo]'
	mkdir -p reports && rm -f reports/zoo.jsonl
	TORCHPORT_FULL_ZOO=1 TORCHPORT_ZOO_REPORT=$(CURDIR)/reports/zoo.jsonl \
		$(BIN)/python -m pytest -q tests/test_zoo.py

# torchao (the `quant` extra), then the int8 example and the quantized tests with it, in the
# three memory modes.
quant: $(PIN)
	$(PIP_EXTRA) '.[quant]'
	$(BIN)/python examples/quantize_int8.py
	$(BIN)/python -m pytest -q tests/test_quantized.py
	TORCHPORT_SIM_STRICT=1 $(BIN)/python -m pytest -q tests/test_quantized.py
	TORCHPORT_SIM_ASYNC=1 $(BIN)/python -m pytest -q tests/test_quantized.py

# The long variants of the reliability tests: random programs with frees, random factories
# and host computations in six threads on both devices against the CPU, in the three sim
# modes (tests/stress_async.py; make test runs a short version), then the reliability tests.
STRESS_ARGS ?= --threads 6 --steps 2000 --rounds 3
stress: $(STAMP)
	rc=0; \
	$(BIN)/python -m tests.stress_async $(STRESS_ARGS) || rc=1; \
	TORCHPORT_SIM_STRICT=1 $(BIN)/python -m tests.stress_async $(STRESS_ARGS) || rc=1; \
	TORCHPORT_SIM_ASYNC=1 $(BIN)/python -m tests.stress_async $(STRESS_ARGS) || rc=1; \
	TORCHPORT_SIM_ASYNC=1 TORCHPORT_SIM_STRICT=1 $(BIN)/python -m tests.stress_async \
		$(STRESS_ARGS) || rc=1; \
	$(BIN)/python -m pytest -q tests/test_reliability_async.py \
		tests/test_reliability_allocator.py || rc=1; \
	exit $$rc

# The differential fuzzer (python -m torchport.tools.fuzz; docs/fuzzing.md): programs 0..N-1 of
# seed SEED, random op programs run on the CPU and on sim in the three modes (worker
# processes), compared step by step; a minimised repro script per class of difference in
# reports/tmp/fuzz/ (copy new ones to tests/fuzz_corpus/). Known open bugs are reported as
# such (src/torchport/tools/fuzz/known.py); fails on an unexplained difference. About 0.3 s
# per program per mode on 2 cores: the defaults take about half an hour.
SEED ?= 0
N ?= 2000
FUZZ_ARGS ?= --modes default,strict,async --jobs 2 --minimise --out reports/tmp/fuzz
fuzz: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m torchport.tools.fuzz --seed $(SEED) --n $(N) $(FUZZ_ARGS)

# Medians and ratios against native CPU in the same run (figures in docs/performance.md).
bench: $(STAMP)
	$(BIN)/python benchmarks/op_overhead.py
	$(BIN)/python benchmarks/op_overhead.py --cold --number 300
	$(BIN)/python benchmarks/models.py --python-floor
	$(BIN)/python benchmarks/models.py --allocator
	TORCHPORT_SIM_ASYNC=1 $(BIN)/python benchmarks/models.py --only tiny
	$(BIN)/python benchmarks/models.py -b bare_sim --only narrow
	TORCHPORT_SIM_STRICT=1 $(BIN)/python benchmarks/models.py -b bare_sim --only narrow
	$(BIN)/python benchmarks/models.py -b bare_ref --only narrow
	$(BIN)/python benchmarks/models.py -b reference --only narrow
	$(BIN)/python benchmarks/autograd_threads.py
	$(BIN)/python benchmarks/models.py --compile --only small
	$(BIN)/python benchmarks/models.py --compile --inference
	$(BIN)/python benchmarks/optimizer_step.py
	$(BIN)/python benchmarks/async_overlap.py
	TORCHPORT_SIM_ASYNC=1 $(BIN)/python benchmarks/async_waits.py
	$(BIN)/python benchmarks/allreduce.py

# Style, then the layers (pyproject.toml, [tool.importlinter]; docs/architecture.md, Layers).
lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	PYTHONPATH=src $(BIN)/lint-imports --no-cache

clean:
	rm -rf $(VENV) .venv-torch-* build *.egg-info src/*.egg-info
