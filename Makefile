# Two commands do all set-up: `make run` and `make test` (README.md).
# The venv lives in .venv at the repo root; torch is pinned so that pip takes the CPU build
# shipped on this project's machines instead of a multi-GB CUDA build.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
TORCH   ?= torch==2.13.0
STAMP   := $(VENV)/.installed

.PHONY: install run test theory toy-assets toy-continuous-assets demo continuous-bench xar-distortion row-parallel paper-table1 speed claims paper-table2 sota-table clean

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install --quiet --upgrade pip
	$(VPY) -m pip install --quiet $(TORCH)
	$(VPY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VPY) run.py

# the tests run in JOBS processes (pytest-xdist; each test file stays in one: its module fixtures are
# built once); every test runs torch on one thread (tests/conftest.py), so 2 processes use 2 cores
JOBS    ?= 2
test: $(STAMP)
	$(VPY) -m pytest -q -n $(JOBS) --dist loadfile --durations=20

theory: $(STAMP)
	$(VPY) -m coolsd.theory

# Retrain every shipped toy-world weight file (deterministic; about 50 min on 2 cores)
toy-assets: $(STAMP)
	$(VPY) -m coolsd.toy.build_assets

# Retrain the toy continuous world (PCA patch codec, MAR target and draft; about 40 min on 2 cores)
toy-continuous-assets: $(STAMP)
	$(VPY) -m coolsd.toy.continuous

# CSpD on the toy continuous world: gamma x batch x mode, speed-up and toy_fid in results/toy_continuous/
continuous-bench: $(STAMP)
	$(VPY) benchmarks/continuous_sweep.py

# How lossy CSpD's parallel verification is on a tiny random xAR pair, exact prefix mode as the reference:
# residuals, energy distance to the target's samples, null band (400 seeds, about 5.5 min on 1 thread)
xar-distortion: $(STAMP)
	$(VPY) benchmarks/xar_cspd_distortion.py

# ZipAR and PJD: tokens per forward and distance to the target, exact (ZipAR) or sampled (PJD) in the lab,
# and on the toy world beside AR (about 15 min on 2 cores) -> results/row_parallel/
row-parallel: $(STAMP)
	$(VPY) benchmarks/row_parallel.py

# The continuous-SD paper's Table 1 grid on TARGET (default the toy continuous world, CPU:
# results/paper_table1/): gamma 4..32 x batch 1 / 16 / 64, the paper's rule beside the official code's
# (inner temperature 42) and the exact rule with prefix verification (gamma 4: it costs several AR runs a
# gamma); DiSA alone and DiSA + CSpD (head steps DISA = upper,lower: 20,5 on the toy's 20-step head, 50,5
# on MAR); every CSpD row beside the target alone with as many forwards (docs/methods.md section 5.3).
# The paper's batch 256 too: PT1_BATCHES=1,16,64,256 PT1_PROMPTS=16,64,256,256. On a GPU e.g.
# make paper-table1 TARGET=mar_h DISA=50,5 OVERRIDES="dataset=imagenet target.device=cuda"
TARGET ?= toy_continuous
OVERRIDES ?=
DISA ?= 20,5
PT1_BATCHES ?= 1,16,64
PT1_PROMPTS ?= 16,64,256
paper-table1: $(STAMP)
	$(VPY) benchmarks/continuous_sweep.py --target $(TARGET) $(foreach o,$(OVERRIDES),--override $(o)) \
		--gammas 4,8,16,32 --exact-gammas 4 --batches $(PT1_BATCHES) --prompts $(PT1_PROMPTS) \
		--modes paper,official,exact --disa $(DISA) --out results/paper_table1/$(TARGET)

# The toy sweep: every method on the same prompts; table + Pareto plot in results/toy/
demo: $(STAMP)
	$(VPY) benchmarks/toy_sweep.py

# Eager vs compiled decoding on the toy world: a round's cost against its forwards, speed-ups vs same-mode AR
speed: $(STAMP)
	$(VPY) benchmarks/speed.py

# The paper's claims at equal accepted length on the toy world (500 prompts, batched) -> results/claims/
claims: $(STAMP)
	$(VPY) benchmarks/claims.py

# The COOL-SD Table 2 layout for TARGETS (comma-separated; toy runs anywhere)
TARGETS ?= toy
paper-table2: $(STAMP)
	$(VPY) -m coolsd.report.table2 --targets $(TARGETS)

# The field's parallel decoders beside the drafted methods on one target, one protocol -> results/sota/
# (SOTA_ARGS: more options, e.g. SOTA_ARGS="--parti-tsv PartiPrompts.tsv"; python -m coolsd.report.sota -h)
SOTA_ARGS ?=
sota-table: $(STAMP)
	$(VPY) -m coolsd.report.sota --targets $(TARGETS) $(SOTA_ARGS)

clean:
	rm -rf $(VENV) outputs multirun
