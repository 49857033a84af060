#!/usr/bin/env bash
# Runs on the GPU machine from the checkout root (see pack_gpu_bundle.sh): unpacks TileLang and
# the kernel cache, then each file of $GPU_TESTS with a time limit, logs under $OUT; with
# SELFCHECK=<seconds> also `python -m torch_dplr --json`.
set -u
t0=$(date +%s)
mkdir -p /tmp/site /tmp/tlc
xz -dc .gpu/site.tar.xz | tar -C /tmp/site -xf -
[ -f .gpu/tlcache.tar.xz ] && xz -dc .gpu/tlcache.tar.xz | tar -C /tmp/tlc -xf -
export PYTHONPATH="$PWD:/tmp/site" TILELANG_CACHE_DIR=/tmp/tlc PYTHONUNBUFFERED=1
echo "setup $(( $(date +%s) - t0 )) s"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, tilelang; print(torch.__version__, tilelang.__version__, torch.cuda.get_device_capability())"
for f in ${GPU_TESTS:-}; do
  name=$(basename "$f" .py); s=$(date +%s)
  timeout "${PER_TEST_TIMEOUT:-120}" python3 -m pytest "$f" -q --maxfail=4 -p no:cacheprovider -rf \
    > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $(( $(date +%s) - s )) s: $(tail -1 "$OUT/$name.log")"
done
if [ -n "${SELFCHECK:-}" ]; then
  s=$(date +%s); timeout "$SELFCHECK" python3 -m torch_dplr --json > "$OUT/selfcheck.jsonl" 2>&1
  echo "selfcheck rc=$? $(( $(date +%s) - s )) s"; grep -E "timing|self_check" "$OUT/selfcheck.jsonl"
fi
echo "total $(( $(date +%s) - t0 )) s"
