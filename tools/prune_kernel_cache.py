"""Packs the live part of a TileLang kernel cache, for carrying to a GPU machine.

A cache filled by ``python -m torch_dplr precompile`` keeps every kernel it ever compiled: after
a kernel edit the old builds stay, and the carried bundle grows past its size limit. This loads
every variant of every kernel family (and any ``--extra`` configurations, e.g. the schedule knobs
``tools/tune_knobs.py`` will time) from the cache, records which kernel directories TileLang
reads, and packs only those, with torch_dplr's build markers and without the compile-time
``cuda-binaries`` folder and the traced TIR (a machine retraces in well under a second), into
``--out`` as a tar.xz. Nothing is compiled: a variant missing from the cache is an error.

    PYTHONPATH=. TILELANG_CACHE_DIR=/tmp/tlc python tools/prune_kernel_cache.py --out /tmp/tlcache.tar.xz \\
        --extra fused_fwd:C=64,K=64,V=64,dtype=bfloat16,threads=256
"""
from __future__ import annotations

import argparse
import glob
import importlib
import os
import tarfile

import tilelang.cache.kernel_cache as tl_cache

from csrc_tl import DSA_KERNEL_MODULES, KERNEL_MODULES
from csrc_tl import compile as tlc
from tune_knobs import parse  # the same family:key=value,... syntax


def _items(extra: list[str]) -> list:
    items = []
    for name in (*KERNEL_MODULES, *DSA_KERNEL_MODULES):
        module = importlib.import_module(f"csrc_tl.{name}")
        items += [(getattr(module, f"{name}_kernel"), config) for config in module.variants()]
    for text in extra:
        name, config = parse(text)
        module = importlib.import_module(f"csrc_tl.{name}")
        items.append((getattr(module, f"{name}_kernel"), config))
    return items


def live_keys(items) -> set[str]:
    """TileLang's cache keys (its kernel directory names) of ``items``, each loaded once."""
    keys, generate = set(), tl_cache.KernelCache._generate_key

    def recording(self, *args, **kwargs):
        key = generate(self, *args, **kwargs)
        keys.add(key)
        return key

    tl_cache.KernelCache._generate_key = recording
    try:
        for factory, config in items:
            if not tlc.on_disk(factory, **config):
                raise SystemExit(f"not in the cache: {factory.__module__} {config} (precompile it first)")
            tlc.build(factory, **config)
    finally:
        tl_cache.KernelCache._generate_key = generate
    return keys


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the tar.xz to write")
    p.add_argument("--extra", action="append", default=[],
                   help="family:key=value,... a configuration beyond the families' variants()")
    args = p.parse_args()
    items = _items(args.extra)
    src = tlc._cache_dir()
    # TileLang keeps a kernel in <version>/<platform>/kernels/<key>
    paths = [path for key in live_keys(items)
             for path in glob.glob(os.path.join(src, "*", "*", "kernels", key))]
    paths += [tlc._marker(f, tlc.cache_key(f, c)) for f, c in items]
    with tarfile.open(args.out, "w:xz", preset=6) as tar:
        for path in paths:
            tar.add(path, arcname=os.path.relpath(path, src))
    print(f"{len(items)} kernels, {os.path.getsize(args.out) / 1e6:.1f} MB: {args.out}")


if __name__ == "__main__":
    main()
