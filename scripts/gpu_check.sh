#!/usr/bin/env bash
# On a CUDA machine, in the repository with its .venv: the token-for-token equivalence tests on the GPU, then
# the engine benchmark on a random LLaDA-8B-shaped model at batch 16 in bfloat16 (dual cache, ACache, ACache
# with FOCUS), and the SmolLM2-135M shape at batch 1/4/16 for the FLOP/s table. Results as JSON under $OUT
# (default build/gpu): tests.json, bench_llada8b.json, bench_smol.json. About 10 minutes on one H200.
set -euo pipefail
OUT=${OUT:-build/gpu}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"

# equivalences on CUDA: engine vs reference, batched vs alone, cached vs uncached, pruning's own definitions
ACACHE_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider --junitxml "$OUT/tests.xml" \
    tests/engine/test_engine.py tests/decoding/test_decoding.py tests/decoding/test_far_mask.py \
    tests/engine/test_affix_cap.py tests/engine/test_focus.py -k "not definition" || true
"$PY" - "$OUT" <<'PYEOF'
import json, sys, xml.etree.ElementTree as ET
out = sys.argv[1]
suite = ET.parse(f"{out}/tests.xml").getroot().find("testsuite")
failed = [c.get("name") for c in suite.iter("testcase") if c.find("failure") is not None or c.find("error") is not None]
summary = {k: int(suite.get(k)) for k in ("tests", "failures", "errors", "skipped")} | {"failed": failed}
open(f"{out}/tests.json", "w").write(json.dumps(summary, indent=2) + "\n")
print(summary)
PYEOF

"$PY" -m acache.cli bench --shape llada-8b --device cuda --dtype bfloat16 --batch-sizes 16 --no-mixed \
    --affix-len 700 --question-len 60 --gen-length 256 --kv-cache-memory 40GiB --focus-layers 4 --focus-ratio 0.25 \
    --json "$OUT/bench_llada8b.json" --overwrite
"$PY" -m acache.cli bench --device cuda --dtype bfloat16 --batch-sizes 1,4,16 --no-mixed \
    --json "$OUT/bench_smol.json" --overwrite
