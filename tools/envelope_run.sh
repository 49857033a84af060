#!/usr/bin/env bash
# The whole benchmark envelope (issue 4) on a GPU host, over several invocations on one host:
# each call runs `bash tools/envelope_run.sh` from the checkout root (with the .gpu/ bundle,
# see pack_gpu_bundle.sh) and picks up where the last call stopped.  Apart from the first step
# (about 100 s, inside the first call) the work runs detached (setsid) and outlives a call, so
# a time limit per command on the host cuts none of it; run the next call soon (the state
# lives in /tmp, which a host that is released loses).
#   1. first_call alone (cold then warm cache; nothing else runs on the host meanwhile)
#   1b. ALONE="cmd": cmd right after, still alone on the host (e.g. an A/B timing that CPU load
#      from the prewarm's compile workers would disturb), logged as alone.log
#   1c. with TESTS: every TileLang kernel variant compiled (python -m torch_dplr precompile),
#      still alone: seconds with a carried kernel cache that holds all of them (see
#      pack_gpu_bundle.sh), a few minutes without.  Tests that compile the variants a carried
#      cache lacks beside the prewarm's FLA compile jobs are slow (42% of their files in
#      900 s)
#   2. in the background: the prewarm (benchmarks.prewarm: FLA's kernels and autotuning
#      candidates, spread over every GPU) and, with TESTS="files", pytest on the last GPU;
#      CHECKS="cmd" runs cmd there after the tests (e.g. compute-sanitizer), logged as tests.log;
#      the job fails when either fails (for CHECKS: its last command's status).
#      SIDE="cmd" runs cmd on GPU 0 meanwhile (e.g. tools/tune_knobs.py) and keeps the prewarm
#      off GPU 0 (on a host of several GPUs), so that its timings have that GPU to themselves
#   3. when all of them are done, and the tests passed (TIME_DESPITE_TESTS=1: whatever they
#      gave): one harness process per GPU (--shard i/n, --no-prewarm),
#      each timing its share of the cells on its own GPU: the comparison cells (fwd, fwd_bwd)
#      first, then the stage cells
#   4. when every shard is done: the shards' JSON lines concatenated into h200.json, and the
#      report (h200.md, h200.png) in $OUT
# Each call waits until the envelope is done or CALL_S seconds (default 540) have passed, then
# leaves the state folder (logs, partial JSON and, once the prewarm started, FLA's autotune
# choices and TileLang kernels as fla_cache.tar.xz: carry it next time with FLA_CACHE=...
# tools/pack_gpu_bundle.sh) in $OUT/envelope.tgz.  When the machine went back between calls,
# `ENVELOPE_STATE=envelope.tgz tools/pack_gpu_bundle.sh` carries that state to a fresh one,
# which continues the run (see the restore below).  NO_FIRST_CALL=1 leaves step 1 out;
# CELLS="regex" prewarms and times only the cells it matches (bench --cells); FIRST_CELLS="regex"
# times the comparison cells it matches first (then CELLS no longer narrows that first pass).
set -u
t0=$(date +%s)
source tools/gpu_setup.sh
W=/tmp/envelope
BENCH=$W/bench
if [ ! -d "$W" ] && [ -f .gpu/envelope_state.tgz ]; then
  # a run continued on a fresh machine (the last one went back): its finished records, its
  # first call and passed tests are kept; what was running there (prewarm, shards) starts
  # again here, the new shards skipping the cells the earlier ones timed
  mkdir -p "$W" && tar xzf .gpu/envelope_state.tgz -C "$W"
  n=$(find "$W" -maxdepth 1 -name 'earlier*.log' | wc -l)
  for started in "$W"/*.started; do  # the background jobs
    [ -f "$started" ] || continue
    job=$(basename "$started" .started)
    [ "$job" = tests ] && [ "$(cat "$W/tests.done" 2>/dev/null)" = 0 ] && continue  # passed there
    [ -f "$W/$job.log" ] && mv "$W/$job.log" "$W/earlier$n-$job.log"
    rm -f "$W/$job.started" "$W/$job.done" "$W/$job.pid"
  done
  rm -f "$W/precompile.done"  # per machine (it fills that machine's kernel cache)
  for f in "$BENCH"/shard*.json; do [ -f "$f" ] && mv "$f" "$BENCH/earlier$n-$(basename "$f")"; done
  [ -f "$W/fla_cache.tar.xz" ] && load_fla_cache "$W/fla_cache.tar.xz"  # FLA's tuning made there
  echo "restored: $(cat "$BENCH"/earlier*.json 2>/dev/null | wc -l) records, first call $([ -f "$W/first_call.done" ] && echo kept || echo not yet)"
fi
mkdir -p "$BENCH"
# the cells an earlier machine timed: neither prewarmed nor timed again
earlier=$(find "$BENCH" -maxdepth 1 -name 'earlier*.json' | sort | tr '\n' ' ')
# and CELLS="regex": only those cells (e.g. the layouts whose FLA tuning is not carried yet);
# as an array for the prewarm, as quoted words for the shards' `bash -c` line
select=(); [ -n "$earlier" ] && select=(--skip-done-in $earlier)
[ -n "${CELLS:-}" ] && select+=(--cells "$CELLS")
select_words=""; [ ${#select[@]} -gt 0 ] && select_words=$(printf ' %q' "${select[@]}")
NGPU=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
CALL_S=${CALL_S:-540}

background() {  # background NAME CMD...: run detached from this call; NAME.done when it ends
  local name=$1; shift
  # shellcheck disable=SC2016
  setsid nohup bash -c 'log=$1 done=$2; shift 2; "$@" > "$log" 2>&1; echo $? > "$done"' \
    _ "$W/$name.log" "$W/$name.done" "$@" < /dev/null > /dev/null 2>&1 &
  echo $! > "$W/$name.pid"  # its process group: kill -- -PID stops it and its children
  touch "$W/$name.started"
  echo "started $name: $*"
}

if [ -n "${NO_FIRST_CALL:-}" ]; then
  echo "first_call left out (NO_FIRST_CALL)"
elif [ ! -f "$W/first_call.done" ]; then
  s=$(date +%s)
  timeout 400 python3 -m torch_dplr bench --modes first_call --no-fla --out "$BENCH" \
    --name first-call > "$W/first_call.log" 2>&1
  echo $? > "$W/first_call.done"
  echo "first_call rc=$(cat "$W/first_call.done") $(( $(date +%s) - s )) s: $(tail -4 "$W/first_call.log" | head -1)"
fi
if [ -n "${ALONE:-}" ] && [ ! -f "$W/alone.done" ]; then
  s=$(date +%s)
  left=$(( CALL_S - 30 - ($(date +%s) - t0) ))  # the call must still write envelope.tgz
  [ "$left" -gt 300 ] && left=300
  timeout "$((left > 10 ? left : 10))" bash -c "$ALONE" > "$W/alone.log" 2>&1
  echo $? > "$W/alone.done"
  echo "alone rc=$(cat "$W/alone.done") $(( $(date +%s) - s )) s"; tail -20 "$W/alone.log"
fi
if [ -n "${TESTS:-}" ] && [ ! -f "$W/precompile.done" ]; then
  # every kernel variant the tests may run, before the prewarm's FLA compile jobs load the host
  # (seconds when the carried kernel cache holds them all)
  s=$(date +%s)
  timeout 400 python3 -m torch_dplr precompile > "$W/precompile.log" 2>&1
  echo $? > "$W/precompile.done"
  echo "precompile rc=$(cat "$W/precompile.done") $(( $(date +%s) - s )) s: $(tail -1 "$W/precompile.log")"
fi
if [ ! -f "$W/prewarm.started" ]; then
  if [ -n "${SIDE:-}" ]; then
    if [ "$NGPU" -gt 1 ]; then
      CUDA_VISIBLE_DEVICES=$(seq -s, 1 $((NGPU - 1))) background prewarm timeout 1500 python3 -m benchmarks.prewarm "${select[@]}"
    else
      background prewarm timeout 1500 python3 -m benchmarks.prewarm "${select[@]}"
    fi
    CUDA_VISIBLE_DEVICES=0 background side timeout 900 bash -c "$SIDE"
  else
    background prewarm timeout 1500 python3 -m benchmarks.prewarm "${select[@]}"
  fi
  if [ -n "${TESTS:-}${CHECKS:-}" ]; then
    # both run whatever the other's outcome; the job fails if either does and says which
    checks="t=0; c=0"
    [ -n "${TESTS:-}" ] && checks="$checks; python3 -m pytest $TESTS -q -p no:cacheprovider -rfE; t=\$?"
    [ -n "${CHECKS:-}" ] && checks="$checks; $CHECKS; c=\$?"
    checks="$checks; echo \"tests rc=\$t, checks rc=\$c\"; [ \$t -eq 0 ] && [ \$c -eq 0 ]"
    CUDA_VISIBLE_DEVICES=$((NGPU - 1)) background tests timeout 1200 bash -c "$checks"
  fi
fi

finished() {  # a background job that was never started counts as finished
  [ ! -f "$W/$1.started" ] || [ -f "$W/$1.done" ]
}
shards_done() {
  for i in $(seq 0 $((NGPU - 1))); do [ -f "$W/shard$i.done" ] || return 1; done
}
last_report=0
while true; do
  now=$(date +%s)
  if [ ! -f "$W/shard0.started" ] && finished prewarm && finished tests && finished side; then
    for job in prewarm tests side; do
      [ -f "$W/$job.done" ] && echo "$job rc=$(cat "$W/$job.done"): $(tail -1 "$W/$job.log")"
    done
    if [ -f "$W/tests.done" ] && [ "$(cat "$W/tests.done")" != 0 ] && [ -z "${TIME_DESPITE_TESTS:-}" ]; then
      # results of code whose tests fail are not results; keep the device time for a fix
      echo "tests failed: no cell timed (TIME_DESPITE_TESTS=1 times them anyway)"
      break
    fi
    for i in $(seq 0 $((NGPU - 1))); do
      shard=""; [ "$NGPU" -gt 1 ] && shard="--shard $i/$NGPU"
      # the comparison cells first, the per-stage breakdown after them (same file, --resume)
      bench="timeout 3000 python3 -m torch_dplr bench --no-prewarm --resume $shard --name shard$i --out $BENCH$select_words"
      passes="$bench --modes fwd,fwd_bwd && $bench --modes stage"
      # FIRST_CELLS: those comparison cells before the others (e.g. the ones whose FLA tuning
      # is not carried: a run cut short then leaves cells that need no tuning)
      [ -n "${FIRST_CELLS:-}" ] && passes="$bench --cells $(printf %q "$FIRST_CELLS") --modes fwd,fwd_bwd && $passes"
      CUDA_VISIBLE_DEVICES=$i background "shard$i" bash -c "$passes"
    done
  fi
  if shards_done; then
    # earlier machines' records first: where a cell is in both, the later record counts
    parts=(); for f in "$BENCH"/earlier*.json "$BENCH"/shard*.json "$BENCH/first-call.json"; do
      [ -f "$f" ] && parts+=("$f"); done
    if python3 -m benchmarks.report "$BENCH/h200.json" --merge "${parts[@]}" > "$W/report.log" 2>&1; then
      cp "$BENCH"/h200.json "$BENCH"/h200.md "$OUT"/ && cp "$BENCH"/h200.png "$OUT"/ 2>/dev/null
      echo "envelope done: $(wc -l < "$BENCH/h200.json") records"
    else
      echo "report failed: $(tail -1 "$W/report.log")"
    fi
    break
  fi
  if [ $((now - t0)) -ge "$CALL_S" ]; then echo "call time up; run this script again"; break; fi
  if [ $((now - last_report)) -ge 60 ]; then
    last_report=$now
    echo "[$((now - t0)) s] prewarm: $(tail -1 "$W/prewarm.log" 2>/dev/null | cut -c1-150)"
    for f in "$BENCH"/shard*.json; do [ -f "$f" ] && echo "  $(basename "$f"): $(wc -l < "$f") records"; done
  fi
  sleep 5
done
if [ -f "$W/prewarm.started" ]; then
  # FLA's autotune choices so far, made on the cells' real inputs, and the TileLang kernels its
  # prewarm compiled (carried next time, FLA tunes nothing and the prewarm compiles only the
  # chosen configs), at every call's end: a machine that goes back before the next call, or a
  # device budget that ends before the shards do, keeps them; niced: shards may be timing
  renice -n 19 $$ > /dev/null 2>&1
  save_fla_cache "$W/fla_cache.tar.xz" tilelang
  echo "fla_cache.tar.xz: $(du -k "$W/fla_cache.tar.xz" | cut -f1) KB"
fi
tar czf "$OUT/envelope.tgz" -C "$W" .  # logs and partial JSON (small: no load on the shards)
echo "total $(( $(date +%s) - t0 )) s"
