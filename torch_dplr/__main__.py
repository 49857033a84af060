"""``python -m torch_dplr``: the self-check (default); ``python -m torch_dplr bench ...``: the
side-by-side benchmark against flash-linear-attention (``benchmarks/`` of the source checkout);
``python -m torch_dplr precompile ...``: compile the TileLang kernels ahead of use."""
import sys


def _bench(argv) -> int:
    try:
        from benchmarks.harness import main as bench_main
    except ImportError as exc:
        if exc.name not in ("benchmarks", "benchmarks.harness"):
            raise
        print("python -m torch_dplr bench needs the benchmarks/ folder of the source checkout: "
              "run it from the repository root", file=sys.stderr)
        return 2
    return bench_main(argv)


if len(sys.argv) > 1 and sys.argv[1] == "bench":
    sys.exit(_bench(sys.argv[2:]))
if len(sys.argv) > 1 and sys.argv[1] == "precompile":
    from .precompile import main as precompile_main

    sys.exit(precompile_main(sys.argv[2:]))

from .selfcheck import main  # noqa: E402

sys.exit(main())
