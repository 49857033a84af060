#!/usr/bin/env bash
# Packs what a GPU run needs into the ignored folder .gpu/ (kept small, under 64 MiB, to copy
# to the GPU host with the checkout): the site bundle of the packages the GPU host lacks
# (TileLang, FLA 0.6.0) and FLA's Triton autotune cache. Kernels are compiled on the GPU host
# itself (16 cores, ~2 min for every variant: `python -m torch_dplr precompile`); a kernel cache
# saved by a GPU run ($OUT/tlcache.tar.xz, see gpu_run.sh) is carried too when KERNEL_CACHE names it,
# and FLA's tuning and TileLang kernels from one ($OUT/fla_cache.tar.xz) when FLA_CACHE does.
# A kernel cache built on this CPU machine (nvcc, no GPU): every variant, which the GPU tests
# need (172 kernels; the envelope's 57 take about 344 s on 2 cores):
#   TILELANG_CACHE_DIR=/tmp/tlc_all python -m torch_dplr precompile
# or only what the benchmark envelope runs:
#   TILELANG_CACHE_DIR=/tmp/tlc_env python -m benchmarks.prewarm --no-fla
# then only the kernels the current sources use (a cache keeps every build of an edited
# kernel), without TileLang's cuda-binaries and the traced TIR:
#   PYTHONPATH=. TILELANG_CACHE_DIR=/tmp/tlc_all python tools/prune_kernel_cache.py --out /tmp/tlc_all.tar.xz
#   (KERNEL_CACHE=/tmp/tlc_all.tar.xz; all 282 variants pack into 11 MB)
# Then, on the GPU host with .gpu/ beside the checkout: `GPU_TESTS="tests/test_cuda.py" bash
# tools/gpu_run.sh`, or the whole benchmark envelope over several invocations:
# `bash tools/envelope_run.sh`.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
[ -f .devsite/site.tar.xz ] || ../shared/device/make-bundle.sh
for folder in /.gpu/ /.gpu.new/; do
  grep -qxF "$folder" .git/info/exclude || echo "$folder" >> .git/info/exclude
done
# packed beside the old bundle, which replaces it only at the end: a cache named by
# KERNEL_CACHE, FLA_CACHE or ENVELOPE_STATE may lie in the old .gpu/
rm -rf .gpu.new && mkdir -p .gpu.new
pack_folder() { tar -C "$1" -cf - . | xz -6 -T0 > "$2"; }  # pack_folder DIR FILE.tar.xz
# the site bundle without z3's command-line binary (z3_solver-*.data, 22 MB; TileLang imports
# the z3 module only), and with z3's libz3.so a link to libz3.so.4.x, of which it is a copy
# (22 MB; 7 MB of the packed bundle): the checkout and .gpu/ must stay under 64 MiB together
if [ ! -f .devsite/site-trimmed.tar.xz ] || [ .devsite/site.tar.xz -nt .devsite/site-trimmed.tar.xz ]; then
  rm -rf /tmp/site_trim && mkdir -p /tmp/site_trim
  xz -dc .devsite/site.tar.xz | tar -C /tmp/site_trim -xf -
  rm -rf /tmp/site_trim/z3_solver-*.data
  for versioned in /tmp/site_trim/z3/lib/libz3.so.*; do
    if cmp -s /tmp/site_trim/z3/lib/libz3.so "$versioned"; then
      ln -sf "$(basename "$versioned")" /tmp/site_trim/z3/lib/libz3.so
    fi
  done
  pack_folder /tmp/site_trim .devsite/site-trimmed.tar.xz
fi
ln -f .devsite/site-trimmed.tar.xz .gpu.new/site.tar.xz
cp .devsite/fla_triton_autotune_h200.tar.xz .gpu.new/
if [ -n "${KERNEL_CACHE:-}" ]; then cp "$KERNEL_CACHE" .gpu.new/tlcache.tar.xz; fi
# FLA's tuning over the benchmark envelope (fla_cache.tar.xz in an envelope.tgz), kept in the
# repository so that a fresh checkout has it: the harness then tunes none of the keys it holds
# (without it FLA's first calls spend about 1600 s tuning over the envelope), and the prewarm
# compiles only their chosen configurations
FLA_CACHE=${FLA_CACHE-benchmarks/results/h200-fla-autotune.tar.xz}
if [ -f "$FLA_CACHE" ]; then cp "$FLA_CACHE" .gpu.new/fla_cache.tar.xz; fi  # gpu_run.sh SAVE_FLA_CACHE
# the state of an unfinished envelope run (its $OUT/envelope.tgz): envelope_run.sh continues it
# on another GPU host
if [ -n "${ENVELOPE_STATE:-}" ]; then cp "$ENVELOPE_STATE" .gpu.new/envelope_state.tgz; fi
# wind_rwkv's chunked_cuda sources (benchmarks/wind_route.py; gpu_setup.sh points
# TORCH_DPLR_WIND_RWKV at them): WIND_SRC is a checkout of github.com/johanwind/wind_rwkv or a
# folder holding just chunked_cuda.py, .cpp, .cu and tile.cuh; only those (and its LICENSE and
# COMMIT stamp) are copied
if [ -n "${WIND_SRC:-}" ]; then
  wind_dir=$WIND_SRC
  [ -f "$wind_dir/chunked_cuda.py" ] || wind_dir=$WIND_SRC/wind_rwkv/rwkv7/chunked_cuda
  mkdir -p .gpu.new/wind_rwkv
  for f in chunked_cuda.py chunked_cuda.cpp chunked_cuda.cu tile.cuh; do cp "$wind_dir/$f" .gpu.new/wind_rwkv/; done
  for f in LICENSE COMMIT; do
    if [ -f "$wind_dir/$f" ]; then cp "$wind_dir/$f" .gpu.new/wind_rwkv/
    elif [ -f "$WIND_SRC/$f" ]; then cp "$WIND_SRC/$f" .gpu.new/wind_rwkv/; fi
  done
  if [ ! -f .gpu.new/wind_rwkv/COMMIT ] && [ -e "$WIND_SRC/.git" ]; then
    echo "github.com/johanwind/wind_rwkv $(git -C "$WIND_SRC" rev-parse HEAD) wind_rwkv/rwkv7/chunked_cuda" \
      > .gpu.new/wind_rwkv/COMMIT
  fi
fi
# pure-Python peers the site bundle lacks (PEER_WHEELS: a folder of wheels, e.g. from
# `pip download --no-deps flash-linear-attention==0.6.0 flashrwkv2==0.1.0a17`: FLA's layers and
# models for benchmarks/layers.py and the layer tests, FlashRWKV2 for benchmarks/decode.py),
# unpacked over the site bundle by gpu_setup.sh
if [ -n "${PEER_WHEELS:-}" ]; then
  rm -rf /tmp/peer_site && mkdir -p /tmp/peer_site
  for w in "$PEER_WHEELS"/*.whl; do python3 -m zipfile -e "$w" /tmp/peer_site; done
  pack_folder /tmp/peer_site .gpu.new/peers.tar.xz
fi
# the commit that travels (the device copy's own .git HEAD can lag the working tree); -dirty
# when the working tree differs from it
git describe --always --dirty --abbrev=7 > .gpu.new/commit
rm -rf .gpu && mv .gpu.new .gpu
du -sh --apparent-size .gpu/*
