# `make run` and `make test` each do all the set-up on a fresh machine.
# GPU users: create .venv with your own CUDA build of torch first; an importable torch is kept.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0
DEMO_MODEL := build/random-llada

.PHONY: install run test lint bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

$(DEMO_MODEL)/config.json: | install
	$(VENV)/bin/acache make-random-checkpoint --family llada --out $(DEMO_MODEL) --layers 4 --hidden-size 128 \
		--heads 4 --std 0.15

run: install $(DEMO_MODEL)/config.json
	@echo "== random-weight demo model: the text is noise, the mechanics are real =="
	$(VENV)/bin/acache generate --model $(DEMO_MODEL) --gen-length 64 --block-length 16 --threshold 0.9 \
		--cache dual --prompt "The affix cache computes a shared span once." --prompt "Where is Mary?"
	@echo "== one shared story (the affix) in three requests; ACache recomputes 20% of it =="
	$(VENV)/bin/acache generate --model $(DEMO_MODEL) --gen-length 16 --block-length 8 --layout infix \
		--affix "Mary moved to the kitchen. John went to the garden. Sandra journeyed to the office." \
		--answer-prompt " Answer:" --affix-policy attention --anchor-ratio 0.2 \
		--prompt "Where is Mary?" --prompt "Where is John?" --prompt "Where is Sandra?"

test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

bench: install
	$(VENV)/bin/acache bench decode

clean:
	rm -rf build .pytest_cache .ruff_cache
