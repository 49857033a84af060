"""An environment variable set for the duration of a block."""
from __future__ import annotations

import contextlib
import os


@contextlib.contextmanager
def scoped_env(name: str, value: str):
    """``os.environ[name] = value`` inside the block; the previous value (or its absence) after."""
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            del os.environ[name]
        else:
            os.environ[name] = saved
