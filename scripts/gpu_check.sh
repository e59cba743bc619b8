#!/usr/bin/env bash
# On a CUDA machine, in the repository: the token-for-token equivalence tests on the GPU, how far a batch is from
# each row alone there, and issue 41's benchmarks (the SmolLM2-135M shape at batch 1 and 16 with the
# Fast-dLLM-style loop and a shallow one pass beside the dual cache and ACache; selection's own cost; a random
# LLaDA-8B shape at batch 1 and 16), and where a step's time goes (profiles, with the step keys on and off). Each
# part has its own time limit and the script carries on past a failure, then exits 1 if any part failed. Results
# under $OUT (default build/gpu): log.txt, tests.xml, bench_smol.json, bench_8b.json, profile_8b.txt,
# profile_smol.txt, stepkeys_8b.txt. Every part: about 11 minutes on one H100.
#
#   PY=.venv/bin/python bash scripts/gpu_check.sh        # a venv with a CUDA torch and acache installed
#   PY=python3 BARE=1 bash scripts/gpu_check.sh          # a python with torch and acache's needs, acache
#                                                        # not installed: its commands found from this tree
#   PARTS="tests profile" bash scripts/gpu_check.sh      # some parts only (env always runs)
set -uo pipefail
OUT=${OUT:-build/gpu}
PY=${PY:-.venv/bin/python}
PARTS=${PARTS:-"smoke invariance tests bench cost bench8b profile stepkeys"}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
: >"$LOG"
if [ -n "${BARE:-}" ]; then
    # `acache bench` comes from the lab's entry point: declare it without installing anything
    site=$(mktemp -d)
    mkdir -p "$site/acache-0.1.0.dist-info"
    printf 'Metadata-Version: 2.1\nName: acache\nVersion: 0.1.0\n' >"$site/acache-0.1.0.dist-info/METADATA"
    printf '[acache.commands]\nlab = acache_lab.cli:register\n' >"$site/acache-0.1.0.dist-info/entry_points.txt"
    export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
part() {  # part NAME SECONDS CMD...: one timed, logged step that may fail without stopping the rest
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date +%T), limit ${limit}s): $*" | tee -a "$LOG"
    local start=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc after $((SECONDS - start))s" | tee -a "$LOG"
    [ "$rc" -eq 0 ] || FAILED="$FAILED $name"
}
FAILED=""
wanted() { [[ " $PARTS " == *" $1 "* ]]; }

part env 15 "$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; \
print(torch.__version__, torch.cuda.get_device_name(), torch.version.cuda)"
grep -q "== env: exit 0" "$LOG" || { echo "no usable CUDA torch: nothing else is run" | tee -a "$LOG"; exit 1; }
# pytest-xdist where it is installed: four workers share the GPU
XDIST=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 4")
wanted smoke && part smoke 45 "$PY" -m acache.cli bench --device cuda --dtype bfloat16 --batch-sizes 1 --no-mixed \
    --affix-len 40 --question-len 8 --gen-length 32 --block-length 16 --steps 8 --fastdllm-loop --anchor-depth 0.25
wanted invariance && part invariance 30 "$PY" -m acache_lab.probes.batch_invariance --device cuda
# equivalences on CUDA: engine vs reference, batched vs alone, cached vs uncached, one pass, pruning
wanted tests && ACACHE_TEST_DEVICE=cuda part tests 150 "$PY" -m pytest -q $XDIST -p no:cacheprovider \
    --junitxml "$OUT/tests.xml" tests/engine/test_engine.py tests/decoding/test_decoding.py \
    tests/decoding/test_far_mask.py tests/engine/test_affix_cap.py tests/engine/test_focus.py \
    tests/affix/test_one_pass.py tests/affix/test_generation.py tests/affix/test_selectors.py \
    tests/models/test_attention.py -k "not definition"
wanted bench && part bench-smol 120 "$PY" -m acache.cli bench --device cuda --dtype bfloat16 --batch-sizes 1,16 \
    --no-mixed --fastdllm-loop --anchor-depth 0.25 --repeats 3 --json "$OUT/bench_smol.json" --overwrite
wanted cost && part one-pass-cost-1 40 "$PY" -m acache_lab.probes.one_pass_cost --device cuda --batch 1 \
    --repeats 7 --anchor-depth 0.25
wanted cost && part one-pass-cost-16 40 "$PY" -m acache_lab.probes.one_pass_cost --device cuda --batch 16 \
    --repeats 5 --anchor-depth 0.25
wanted bench8b && part bench-8b 120 "$PY" -m acache.cli bench --shape llada-8b --device cuda --dtype bfloat16 \
    --batch-sizes 1,16 --no-mixed --fastdllm-loop --kv-cache-memory 24GiB --json "$OUT/bench_8b.json" --overwrite
wanted profile && part profile-8b 150 bash -c "$PY -m acache_lab.probes.step_profile --device cuda \
    --shape llada-8b --batch 16 --repeats 1 --rows 15 >$OUT/profile_8b.txt 2>&1; s=\$?; grep '^===\|host reads\|total' \
    $OUT/profile_8b.txt; exit \$s"
wanted profile && part profile-smol 40 bash -c "$PY -m acache_lab.probes.step_profile --device cuda \
    --batch 16 --repeats 3 --rows 15 >$OUT/profile_smol.txt 2>&1; s=\$?; grep '^===\|host reads\|total' \
    $OUT/profile_smol.txt; exit \$s"
# the in-block step with a block's keys rotated once a refresh (reuse_step_keys, off by default on a GPU)
wanted stepkeys && part stepkeys-8b 120 bash -c "$PY -m acache_lab.probes.step_profile --device cuda \
    --shape llada-8b --batch 16 --repeats 1 --rows 10 --reuse-step-keys on >$OUT/stepkeys_8b.txt 2>&1; s=\$?; \
    grep '^===\|total' $OUT/stepkeys_8b.txt; exit \$s"
[ -z "$FAILED" ] || { echo "failed or timed out:$FAILED" | tee -a "$LOG"; exit 1; }
