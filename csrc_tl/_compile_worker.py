"""``python -m csrc_tl._compile_worker MODULE FACTORY CONFIG_JSON``: compile one kernel into the
disk cache. :func:`csrc_tl.compile.build_all` runs one per core; a fresh interpreter (not a
multiprocessing child, which would re-import the caller's main script) keeps user code out."""
import importlib
import json
import sys
import time

from csrc_tl.compile import build

module, name, config = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
start = time.perf_counter()
build(getattr(importlib.import_module(module), name), **config)
print(f"{time.perf_counter() - start:.3f}")
