#!/bin/bash
# Issue #10's sweep on a GPU machine, then the exactness tests on CUDA. Run from the repository root
# with specdec importable (e.g. PYTHONPATH=$PWD plus its dependencies) and the embedded model
# convertible; results go to ${OUT:-gpu-out}. Budget: SWEEP_S seconds for the sweep, TESTS_S for tests.
#   SWEEP_S=420 TESTS_S=150 bash scripts/gpu_sweep.sh
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -c "from specdec.models import embedded_model_dir; print(embedded_model_dir())" || exit 1
# GPU clocks and utilisation beside the run: launch-bound passes may not lift the clocks.
nvidia-smi dmon -s pucm -d 1 > "$OUT/dmon.log" 2>&1 &
DMON=$!
timeout "${SWEEP_S:-420}" python3 -m specdec.cli bench --up --prompts mt_bench --limit "${LIMIT:-16}" \
  --max-new-tokens "${NEW_TOKENS:-64}" --systems spec,baseline --concurrency "${LEVELS:-1,2,4,8,16}" \
  --no-progress --out "$OUT/sweep" > "$OUT/sweep.log" 2>&1
echo "sweep rc=$?"
pkill -TERM -f "specdec.cli (up|serve)"; sleep 2
tail -4 "$OUT/sweep.log"
SPECDEC_TEST_DEVICE=cuda SPECDEC_DTYPE=float32 timeout "${TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider \
  --timeout 60 tests/test_greedy_equality.py tests/test_batching.py tests/test_distribution.py -rA > "$OUT/gpu_tests.log" 2>&1
echo "tests rc=$?"; grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -40
kill $DMON 2>/dev/null
tar czf "$OUT.tgz" "$OUT"
