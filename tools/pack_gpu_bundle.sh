#!/usr/bin/env bash
# Packs what a GPU run needs into the ignored folder .gpu/ (it must be under the device tool's
# 64 MiB carry limit): the TileLang site bundle from ../shared/device/make-bundle.sh and the
# kernels compiled here into .devsite/tilelang-cache, xz-compressed (~14x smaller; the raw
# cache is far too big to carry).  Then:  device run, carry [".gpu"],
#   GPU_TESTS="tests/test_cuda.py tests/test_tl_state_fwd.py" bash tools/gpu_run.sh
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
[ -f .devsite/site.tar.xz ] || ../shared/device/make-bundle.sh
grep -qxF '/.gpu/' .git/info/exclude || echo '/.gpu/' >> .git/info/exclude
mkdir -p .gpu
ln -f .devsite/site.tar.xz .gpu/site.tar.xz
tar -C .devsite/tilelang-cache -cf - "$(python3 -c 'import tilelang; print(tilelang.__version__)')/linux-x86_64" \
  | xz -T0 -6 > .gpu/tlcache.tar.xz
du -sh --apparent-size .gpu/*
