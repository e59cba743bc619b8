# `make run` and `make test` each do all the set-up on a fresh machine.
# GPU users: create .venv with your own CUDA build of torch first; an importable torch is kept.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0
MODEL := models/acache-tiny
PLUS := models/acache-tiny-plus
BLOCKDIFF := models/acache-tiny-blockdiff
R2LM := models/acache-tiny-r2lm
SSM := models/acache-tiny-ssm
STUDY := docs/study

.PHONY: install run test test-long lint bench study study-affix model model-affix model-plus model-blockdiff model-r2lm model-ssm eval-lm clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "== setting up $(VENV): pip, then torch (a CPU build, about 200 MB; kept if the venv has one), then acache"
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[dev]'
	@echo "== $(VENV) is ready"
	touch $@

run: install
	@$(VENV)/bin/acache demo --model $(MODEL)

test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check .

# the property-based engine test at 3,000 drawn batches a model family instead of 150, and the server's
# body fuzz at 3,000 examples instead of 300 (about 20 minutes)
test-long: install
	ACACHE_HYPOTHESIS_PROFILE=long ACACHE_FUZZ_EXAMPLES=3000 $(PY) -m pytest -q tests/engine/test_properties.py \
		tests/server/test_app.py

# lm-evaluation-harness (installed here as the lmeval extra) against a started `acache serve`, on the shipped
# model's own tasks: two generate-until, two multiple-choice through echo+logprobs (docs/lm_eval.md; 19
# minutes on 2 CPU cores that another job shared)
eval-lm: install
	$(PY) -m pip install -q -e '.[lmeval]'
	$(VENV)/bin/acache eval lm --model $(MODEL) --limit 50 --out build/lm_eval

bench: install
	$(VENV)/bin/acache bench decode

# the accuracy study of docs/accuracy.md on the shipped model: the task scores, the staleness profile and the
# sweep over tasks x layouts x selectors x anchor ratios (300 held-out requests a point), BiCache's profiled
# depth table calibrated on task requests outside the held-out stream
study: install
	$(VENV)/bin/acache eval tasks --model $(MODEL) --json $(STUDY)/tasks.json --overwrite
	$(VENV)/bin/acache eval staleness --model $(MODEL) --out $(STUDY) --overwrite
	$(VENV)/bin/acache bicache-profile --model $(MODEL) --calibration tasks --samples 120 --gen-length 2 \
		--out $(STUDY)/bicache_profile.json --overwrite
	$(VENV)/bin/acache eval accuracy --model $(MODEL) --examples 300 --seed 0 --out $(STUDY) \
		--bicache-profile $(STUDY)/bicache_profile.json --overwrite
	$(VENV)/bin/acache eval accuracy --model $(PLUS) --tasks codes --layouts prefix,infix,suffix,two-affix \
		--sentences 6 --examples 300 --seed 0 --out $(STUDY)/demonstrations --overwrite
	$(VENV)/bin/acache eval accuracy --model $(PLUS) --tasks qa1,twohop --sentences 34 --examples 300 --seed 0 \
		--out $(STUDY)/long --overwrite
	$(VENV)/bin/acache eval accuracy --model $(MODEL) --examples 300 --seed 0 \
		--selectors attention,attention-probe-step --ratios 0.2,1.0 --out $(STUDY)/probe_step --overwrite
	$(VENV)/bin/acache eval accuracy --model $(BLOCKDIFF) --layouts prefix,infix --examples 300 --seed 0 \
		--selectors attention,cacheblend,first-k,random --ratios 0.2,1.0 --out $(STUDY)/blockdiff --overwrite

# retrains the shipped model from its seed (docs/model.md, run 30): four configs, 83 minutes on 2 CPU cores,
# then its held-out scores; it overwrites $(MODEL), which git can restore
RECIPE := run30-stage1 run30-stage1-cont run30-stage2 run30-cont
model: install
	OMP_NUM_THREADS=2 $(VENV)/bin/acache train $(foreach c,$(RECIPE),--config configs/$(c).json) --overwrite
	$(VENV)/bin/acache eval tasks --model $(MODEL)

# the second shipped model (docs/model.md, "acache-tiny-plus"): the shipped model fine-tuned on the paper's
# demonstration setting (codes) and on documents past 200 tokens; one config, about 36 minutes on 2 CPU cores (35.2 training)
model-plus: install
	OMP_NUM_THREADS=2 $(VENV)/bin/acache train --config configs/plus.json --overwrite
	$(VENV)/bin/acache eval tasks --model $(PLUS) --tasks qa1,arith,twohop,codes
	$(VENV)/bin/acache eval tasks --model $(PLUS) --tasks qa1,twohop --sentences 34

# the affix-aware model (docs/model.md, "acache-tiny-affix"): the plus model fine-tuned with nine rows in ten
# attending as direct reuse serves them, mostly `grab` (the binding under direct reuse), with the neighbour term,
# in two configs, then on the study's mix with three rows in four so, then twice on that mix with the two-affix
# demonstrations drawn more, four rows in five isolated and the bridge term (the other tasks' two-affix draws in any
# plain layout), the second of those also held to the plus model's in-context predictions (the teacher term), that
# second one three times more with one thing changed (seed, more long qa1, no teacher), then a stage from the mean of
# those four (a soup) with the teacher where half the isolated rows also recompute a fifth of each affix (anchored
# rows, the one-pass form); about 6 + 7 + 13 + 5 + 6 + 5 + 6 + 5 + 5 minutes on a 2-core AMD EPYC VM (the first five
# took 8 + 9 + 19 + 10 + 8 on an Intel Xeon one)
AFFIX := models/acache-tiny-affix
model-affix: install
	OMP_NUM_THREADS=2 $(VENV)/bin/acache train --config configs/affix-bind.json --config configs/affix-bind-2.json \
	  --config configs/affix-mix.json --config configs/affix-bridge-mix.json --config configs/affix-bridge-mix-2.json \
	  --config configs/affix-bridge-mix-2-seed93.json --config configs/affix-bridge-mix-2-longqa.json \
	  --config configs/affix-bridge-mix-2-noteacher.json --config configs/affix-anchored.json --overwrite
	$(VENV)/bin/acache eval tasks --model $(AFFIX) --tasks qa1,arith,twohop,codes

# docs/accuracy.md "Affix-aware training": direct reuse, ACache 0.2 and full recomputation before (the plus
# model) and after (the affix model) on the study's cells, the table and the plot (about 10 minutes)
study-affix: install
	for m in plus affix; do \
	  $(VENV)/bin/acache eval accuracy --model models/acache-tiny-$$m --tasks qa1,arith,twohop --selectors attention \
	    --ratios 0,0.2,1.0 --examples 300 --seed 0 --out $(STUDY)/affix_training/$$m/base --overwrite && \
	  $(VENV)/bin/acache eval accuracy --model models/acache-tiny-$$m --tasks codes --layouts prefix,infix,suffix,two-affix \
	    --sentences 6 --selectors attention --ratios 0,0.2,1.0 --examples 300 --seed 0 \
	    --out $(STUDY)/affix_training/$$m/demonstrations --overwrite && \
	  $(VENV)/bin/acache eval accuracy --model models/acache-tiny-$$m --tasks qa1,twohop --sentences 34 \
	    --selectors attention --ratios 0,0.2,1.0 --examples 300 --seed 0 --out $(STUDY)/affix_training/$$m/long \
	    --overwrite || exit 1; done
	$(PY) -m acache_lab.eval.affix_training_table $(STUDY)/affix_training/plus $(STUDY)/affix_training/affix \
	  --md $(STUDY)/affix_training/before_after.md --plot $(STUDY)/affix_training/accuracy_compute.png

# the block-diffusion model (docs/model.md, "acache-tiny-blockdiff"): the R2LM model's weights (below) in the
# Fast-dLLM v2 layout (block-causal attention, blocks of 8, shifted logits), fine-tuned in one config on the prefix
# and infix layouts (a block-causal model cannot read an affix after its answer); 12-15 minutes on 2 CPU cores
model-blockdiff: install
	OMP_NUM_THREADS=2 $(VENV)/bin/acache train --config configs/blockdiff.json --overwrite
	$(VENV)/bin/acache eval tasks --model $(BLOCKDIFF) --layouts prefix,infix

# the R2LM model (docs/model.md, "acache-tiny-r2lm"): the shipped model's attention made causal, a reverse scan
# added inside blocks of 8 (starting silent), fine-tuned in three configs on the prefix and infix layouts
model-r2lm: install
	OMP_NUM_THREADS=2 $(VENV)/bin/acache train --config configs/r2lm-stage1.json --config configs/r2lm-stage2.json \
		--config configs/r2lm.json --overwrite
	$(VENV)/bin/acache eval tasks --model $(R2LM) --layouts prefix,infix

# the state-space model (docs/model.md, "Attempt 11"): the shipped model's weights where the names match
# (embeddings, MLPs), a Mamba-style scan in place of attention, one config on the prefix and infix layouts;
# about 80 minutes on 2 CPU cores
model-ssm: install
	OMP_NUM_THREADS=2 $(VENV)/bin/acache train --config configs/ssm-tiny.json --overwrite
	$(VENV)/bin/acache eval tasks --model $(SSM) --layouts prefix,infix

clean:
	rm -rf build .pytest_cache .ruff_cache
