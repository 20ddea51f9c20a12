#!/bin/bash
# The one GPU check (issue #26), about 8 minutes, one results folder ($OUT, default gpu-out):
#   1. environment and clocks (nvidia-smi, torch, the commit), nvidia-smi dmon beside everything
#   2. the target's pass per (sessions x new tokens), eager against CUDA graphs, fp32 and bf16
#      (scripts/pass_curve.py: the 1-token pass and verify-8 / 1-token for docs/benchmarks.md)
#   3. the exactness tests on CUDA: fp32 on static passes replayed as graphs (greedy equality,
#      batching, distribution, static KV, host reads of the logits), and bf16 in --batch-invariant mode (speculation equals
#      decoding one token at a time)
#   4. spec vs baseline vs hf vs hf-assisted at one stream, then spec vs baseline at 1-16 streams
# Run from the repository root with specdec importable (PYTHONPATH=$PWD plus its dependencies) and
# the embedded model convertible. Budgets in seconds: CURVE_S, TESTS_S, ONE_S, SWEEP_S.
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
step() { echo "== $(date -u +%H:%M:%S) $*"; }
step environment
{ nvidia-smi; nvidia-smi -q -d CLOCK,PERFORMANCE | head -60; git rev-parse HEAD 2>/dev/null
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
} > "$OUT/environment.txt" 2>&1
python3 -c "from specdec.models import embedded_model_dir; print(embedded_model_dir())" || exit 1
nvidia-smi dmon -s pucm -d 1 > "$OUT/dmon.log" 2>&1 &
DMON=$!

step pass curve
for dtype in float32 bfloat16; do
  timeout "${CURVE_S:-40}" python3 scripts/pass_curve.py --device cuda --dtype $dtype --reps 20 \
    --out "$OUT/pass_curve_$dtype.json" > "$OUT/pass_curve_$dtype.log" 2>&1
  echo "curve $dtype rc=$?"; grep -E "one token|x1 |x8 " "$OUT/pass_curve_$dtype.log" | head -14
done

step exactness tests on CUDA
SPECDEC_TEST_DEVICE=cuda SPECDEC_DTYPE=float32 timeout "${TESTS_S:-120}" python3 -m pytest -q -p no:cacheprovider \
  --timeout 60 -m "gpu and not embedded" -rA > "$OUT/gpu_tests_fp32.log" 2>&1
echo "fp32 tests rc=$?"; grep -E "passed|failed" "$OUT/gpu_tests_fp32.log" | tail -3
SPECDEC_TEST_DEVICE=cuda SPECDEC_DTYPE=bfloat16 timeout 45 python3 -m pytest -q -p no:cacheprovider --timeout 40 \
  tests/test_static_kv.py -k "batch_invariant_speculation" -rA > "$OUT/gpu_tests_bf16_invariant.log" 2>&1
echo "bf16 batch-invariant rc=$?"; grep -E "passed|failed" "$OUT/gpu_tests_bf16_invariant.log" | tail -2

step one stream: spec, baseline, hf, hf-assisted
timeout "${ONE_S:-80}" python3 -m specdec.cli bench --up --prompts mt_bench --limit 8 --max-new-tokens 64 \
  --systems spec,baseline,hf,hf-assisted --no-progress --out "$OUT/one_stream" > "$OUT/one_stream.log" 2>&1
echo "one stream rc=$?"; pkill -TERM -f "specdec.cli (up|serve)"; sleep 2; tail -12 "$OUT/one_stream.log"

step concurrency sweep
timeout "${SWEEP_S:-150}" python3 -m specdec.cli bench --up --prompts mt_bench --limit "${LIMIT:-16}" \
  --max-new-tokens "${NEW_TOKENS:-64}" --systems spec,baseline --concurrency "${LEVELS:-1,2,4,8,16}" \
  --no-progress --out "$OUT/sweep" > "$OUT/sweep.log" 2>&1
echo "sweep rc=$?"; pkill -TERM -f "specdec.cli (up|serve)"; sleep 2; tail -8 "$OUT/sweep.log"

kill $DMON 2>/dev/null
step done
tar czf "$OUT.tgz" "$OUT"
