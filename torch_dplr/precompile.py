"""``python -m torch_dplr precompile``: compile the TileLang kernels before first use.

Without options it compiles every kernel variant the library can run: the DPLR kernels
(172) and the DSA ops' (``csrc_tl.DSA_KERNEL_MODULES``: the sparse MLA forward and backward,
the indexer with its top-k, the index scores forward and backward, the KL loss forward; 56);
a GPU host with 16 cores needs a few minutes, once.
``--family dplr`` or ``--family dsa`` compiles one family's variants only.  With
``--chunk-size``/``--head-dim``/``--dtype`` only the DPLR kernels of that configuration
(what first calls would compile: the six stage kernels, the small-grid state backward's two,
and the fused no-grad forward where it applies).  Kernels land in TileLang's disk cache
(``TILELANG_CACHE_DIR``, default ``~/.tilelang/cache``).  No GPU is needed: a cache filled on
a CPU machine with nvcc serves the H100/H200.
"""
from __future__ import annotations

import argparse
import sys
import time

def main(argv=None) -> int:
    import torch

    parser = argparse.ArgumentParser(prog="python -m torch_dplr precompile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunk-size", type=int, choices=(16, 32, 64))
    parser.add_argument("--head-dim", type=int, choices=(64, 128), help="K = V")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--gate-dtype", choices=("float32", "same"), default="float32",
                        help="dtype of gk: float32 or the same as --dtype")
    parser.add_argument("--lower-bound", type=float, default=float("-inf"),
                        help="declared gate bound (e.g. -0.6065 for RWKV-7)")
    parser.add_argument("--family", choices=("all", "dplr", "dsa"), default="all",
                        help="without a configuration: whose variants to compile")
    parser.add_argument("--workers", type=int, default=None, help="compile processes (default: cores)")
    args = parser.parse_args(argv)
    try:
        import csrc_tl
    except ImportError as exc:
        print(f"TileLang is not installed ({exc}); install the 'cuda' extra", file=sys.stderr)
        return 1
    from .ops.kernels import _progress, pipeline

    start = time.perf_counter()
    if args.chunk_size is None and args.head_dim is None:
        families = dict(dplr=csrc_tl.KERNEL_MODULES, dsa=csrc_tl.DSA_KERNEL_MODULES)
        items = [item for name in (families if args.family == "all" else [args.family])
                 for item in csrc_tl.every_variant(families[name])]
    elif args.chunk_size is None or args.head_dim is None:
        parser.error("--chunk-size and --head-dim go together (or neither, for every variant)")
    elif args.family == "dsa":
        parser.error("--chunk-size and --head-dim name a DPLR configuration, not a DSA one")
    else:
        dtype = getattr(torch, args.dtype)
        gate = dtype if args.gate_dtype == "same" else torch.float32
        items = list(pipeline(args.chunk_size, args.head_dim, args.head_dim, dtype, gate,
                              args.lower_bound).values())
    csrc_tl.build_all(items, workers=args.workers, progress=_progress, load=False)
    print(f"{len(items)} kernels ready in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
