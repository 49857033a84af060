"""``python -m csrc_tl._compile_worker``: a compiler process for :func:`csrc_tl.compile.build_all`.

Reads one job per line on stdin, ``[module, factory name, config]``, compiles that kernel into
the disk cache and answers one line per job on stdout: ``{"ok": true, "seconds": s}`` or
``{"ok": false, "error": "<end of the traceback>"}``; exits at the end of its input. A fresh
interpreter (not a multiprocessing child, which would re-import the caller's main script)
that lives for many jobs, so torch and TileLang are imported once per process, not per kernel.
"""
import importlib
import json
import os
import sys
import time
import traceback

# answers go to the original stdout; everything else printed there, by Python or by native
# code writing to file descriptor 1, goes to stderr instead
answers = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr

from csrc_tl.compile import build  # noqa: E402

for line in sys.stdin:
    module, name, config = json.loads(line)
    start = time.perf_counter()
    try:
        build(getattr(importlib.import_module(module), name), **config)
        answer = {"ok": True, "seconds": time.perf_counter() - start}
    except Exception:  # noqa: BLE001 (the parent reports it with the kernel's name)
        answer = {"ok": False, "error": "\n".join(traceback.format_exc().strip().splitlines()[-20:])}
    answers.write(json.dumps(answer) + "\n")
    answers.flush()
