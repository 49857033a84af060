#!/usr/bin/env bash
# Sourced by tools/gpu_run.sh and tools/envelope_run.sh on the GPU machine, from the checkout
# root (carry [".gpu"], see pack_gpu_bundle.sh): unpacks the site bundle and the carried caches
# once per machine (a warm machine keeps /tmp), exports the environment every step needs, and
# sets t0 (the script's start) for the timings.
t0=${t0:-$(date +%s)}
mkdir -p /tmp/site /tmp/tlc ~/.triton/cache
load_fla_cache() {  # load_fla_cache FILE: a save_fla_cache archive into the caches, keeping what
  # is there (its triton/ autotune results, its tlc/ TileLang kernels, either may be absent)
  rm -rf /tmp/flacache && mkdir -p /tmp/flacache && xz -dc "$1" | tar -C /tmp/flacache -xf -
  [ -d /tmp/flacache/triton ] && cp -rn /tmp/flacache/triton/. ~/.triton/cache/
  [ -d /tmp/flacache/tlc ] && cp -rn /tmp/flacache/tlc/. /tmp/tlc/
  return 0
}
if [ ! -f /tmp/site/.done ]; then  # once per machine (a warm machine keeps /tmp)
  xz -dc .gpu/site.tar.xz | tar -C /tmp/site -xf -
  [ -f .gpu/peers.tar.xz ] && xz -dc .gpu/peers.tar.xz | tar -C /tmp/site -xf -
  [ -f .gpu/tlcache.tar.xz ] && xz -dc .gpu/tlcache.tar.xz | tar -C /tmp/tlc -xf -
  [ -f .gpu/fla_triton_autotune_h200.tar.xz ] && tar -C ~/.triton/cache -xJf .gpu/fla_triton_autotune_h200.tar.xz
  [ -f .gpu/fla_cache.tar.xz ] && load_fla_cache .gpu/fla_cache.tar.xz  # see SAVE_FLA_CACHE
  touch /tmp/site/.done
fi
export PYTHONPATH="$PWD:/tmp/site" TILELANG_CACHE_DIR=/tmp/tlc PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1
# wind_rwkv's chunked_cuda sources when packed (WIND_SRC=... pack_gpu_bundle.sh): the bench's
# wind_rwkv column (benchmarks/wind_route.py builds them here with nvcc and ninja)
if [ -d .gpu/wind_rwkv ]; then export TORCH_DPLR_WIND_RWKV="$PWD/.gpu/wind_rwkv"; fi
# the commit the results name (see pack_gpu_bundle.sh; benchmarks.harness reads it)
[ -f .gpu/commit ] && export TORCH_DPLR_GIT_COMMIT="$(cat .gpu/commit)"
echo "setup $(( $(date +%s) - t0 )) s"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, tilelang; print(torch.__version__, tilelang.__version__, torch.cuda.get_device_capability())"

save_fla_cache() {  # save_fla_cache DEST [tilelang]: what FLA tuned here (Triton autotune results),
  # the Triton kernels compiled on this machine (FLA's and ours: a cold machine spends minutes
  # compiling FLA's for its layer tests) and, with "tilelang", the TileLang kernels compiled
  # here, as a tar.xz that pack_gpu_bundle.sh FLA_CACHE=DEST carries next time (gpu_setup.sh
  # unpacks it; Triton finds a kernel by its directory, named by the hash of its source and
  # options)
  rm -rf /tmp/flasave && mkdir -p /tmp/flasave/triton /tmp/flasave/tlc
  (cd ~/.triton/cache && find . -name '*.autotune.json' -exec cp --parents {} /tmp/flasave/triton/ \;)
  (cd ~/.triton/cache && find . -mindepth 1 -maxdepth 1 -type d -newer /tmp/site/.done \
     -exec cp -r --parents {} /tmp/flasave/triton/ \;)
  if [ "${2:-}" = tilelang ]; then
    (cd /tmp/tlc && find 0.1.15 -mindepth 2 -maxdepth 3 -type d -newer /tmp/site/.done \
       \( -path '*/kernels/*' -o -path '*/cuda-binaries/*' \) -exec cp -r --parents {} /tmp/flasave/tlc/ \;)
  fi
  tar -C /tmp/flasave -cf - . | xz -T0 -6 > "$1"
}
