#!/usr/bin/env bash
# Runs on the GPU machine from the checkout root (carry [".gpu"], see pack_gpu_bundle.sh).
# Steps, each logged under $OUT and timed:
#   PRECOMPILE=1        compile every kernel variant in parallel (python -m torch_dplr precompile)
#   GPU_TESTS="f1 f2"   pytest each file (PER_TEST_TIMEOUT s each, default 300)
#   SANITIZE=1          compute-sanitizer racecheck + memcheck over tools/sanitize_kernels.py
#   SELFCHECK=<s>       python -m torch_dplr --json
#   EXTRA="<cmd>"       any further command (EXTRA_TIMEOUT s, default 300), logged as extra.log
#   BENCH="<args>"      python -m torch_dplr bench <args> (results under $OUT/bench)
#     DEADLINE_S=<s>    cut the bench at this many seconds after the script started (for a
#                       host that limits a command's time; a cut run keeps every finished cell)
#     BENCH_OUT=<dir>   write them there instead and copy them to $OUT/bench after: a folder
#                       outside the checkout (e.g. /tmp/bench) survives between invocations on
#                       the same host, so `--resume` continues a run split over several
#   PROFILE="<args>"    tools/profile_pipeline.py <args>: per-kernel device time ($OUT/profile.*)
#   NCU_KERNEL=<regex>  Nsight Compute on one launch of the kernels matching it (the third, past
#                       warm-ups), made by NCU_CMD: stall reasons, occupancy, pipe use and source
#                       counters as $OUT/ncu.txt and the report $OUT/ncu.ncu-rep
#   SAVE_CACHE=1        the compiled kernels as $OUT/tlcache.tar.xz, to carry next time (without
#                       TileLang's compile-time cuda-binaries folder: loading reads kernels/ only)
#   SAVE_FLA_CACHE=1    what FLA tuned and compiled here (Triton autotune results, Triton and
#                       TileLang kernels) as $OUT/fla_cache.tar.xz; pack_gpu_bundle.sh FLA_CACHE=... carries
#                       it, so the next machine neither re-tunes nor re-JITs FLA
set -u
t0=$(date +%s)
source tools/gpu_setup.sh
step() {  # step NAME TIMEOUT CMD...: run, log to $OUT/NAME.log, print rc, time and last line
  local name=$1 limit=$2; shift 2; local s; s=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $(( $(date +%s) - s )) s: $(tail -1 "$OUT/$name.log")"
}
if [ -n "${PRECOMPILE:-}" ]; then step precompile 400 python3 -m torch_dplr precompile; fi
for f in ${GPU_TESTS:-}; do
  step "$(basename "$f" .py)" "${PER_TEST_TIMEOUT:-300}" python3 -m pytest "$f" -q -p no:cacheprovider -rfE ${PYTEST_EXTRA:-}
done
if [ -n "${SANITIZE:-}" ]; then
  for tool in racecheck memcheck; do
    step "sanitize_$tool" 300 compute-sanitizer --tool "$tool" --error-exitcode 9 python3 tools/sanitize_kernels.py
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|hazard" "$OUT/sanitize_$tool.log" | tail -3
  done
fi
if [ -n "${SELFCHECK:-}" ]; then
  step selfcheck "$SELFCHECK" python3 -m torch_dplr --json
  grep -E "timing|self_check" "$OUT/selfcheck.log"
fi
if [ -n "${EXTRA:-}" ]; then  # any further command, e.g. tools/tune_knobs.py
  step extra "${EXTRA_TIMEOUT:-300}" bash -c "$EXTRA"
  tail -40 "$OUT/extra.log"
fi
if [ -n "${BENCH:-}" ]; then
  bench_out=${BENCH_OUT:-$OUT/bench}
  mkdir -p "$bench_out"
  limit=${BENCH_TIMEOUT:-400}
  if [ -n "${DEADLINE_S:-}" ]; then
    left=$(( DEADLINE_S - ($(date +%s) - t0) )); [ "$left" -lt "$limit" ] && limit=$left
  fi
  if [ "$limit" -lt 30 ]; then
    echo "bench skipped: $limit s left before DEADLINE_S"
  else
    # shellcheck disable=SC2086
    step bench "$limit" python3 -m torch_dplr bench --out "$bench_out" $BENCH
  fi
  if [ "$bench_out" != "$OUT/bench" ]; then  # a run cut by the timeout has no report yet
    for f in "$bench_out"/*.json; do python3 -m benchmarks.report "$f" > /dev/null 2>&1; done
    mkdir -p "$OUT/bench" && cp "$bench_out"/* "$OUT/bench/"
  fi
fi
if [ -n "${PROFILE+x}" ]; then
  # shellcheck disable=SC2086
  step profile 300 python3 tools/profile_pipeline.py --out "$OUT/profile.jsonl" $PROFILE
  grep -A12 "^==" "$OUT/profile.log"
fi
if [ -n "${NCU_KERNEL:-}" ]; then
  if command -v ncu > /dev/null; then
    step ncu "${NCU_TIMEOUT:-300}" ncu --kernel-name "regex:$NCU_KERNEL" --launch-skip 2 --launch-count 1 \
      --set full --import-source yes -o "$OUT/ncu" -f bash -c "$NCU_CMD"
    ncu --import "$OUT/ncu.ncu-rep" --page details > "$OUT/ncu.txt" 2>&1
    grep -E "Duration|Registers|Achieved Occupancy|Stall|Issue Slots|Warp Cycles Per Issued" "$OUT/ncu.txt" | head -30
  else
    echo "ncu: not on this machine"
  fi
fi
if [ -n "${SAVE_CACHE:-}" ]; then
  tar -C /tmp/tlc --exclude='./*/cuda-binaries' -cf - . | xz -T0 -6 > "$OUT/tlcache.tar.xz"
  ls -la "$OUT/tlcache.tar.xz"
fi
if [ -n "${SAVE_FLA_CACHE:-}" ]; then  # autotune results, Triton and TileLang kernels made here
  save_fla_cache "$OUT/fla_cache.tar.xz" tilelang; ls -la "$OUT/fla_cache.tar.xz"
fi
echo "total $(( $(date +%s) - t0 )) s"
