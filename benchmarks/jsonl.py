"""One record of a measurement script: printed as a JSON line and appended to its ``--out``."""
from __future__ import annotations

import json


def emit(record: dict, out: str | None, digits: int | None = None) -> None:
    """Print ``record`` as one JSON line (floats rounded to ``digits`` when given) and append
    it to the file ``out`` when one is named."""
    if digits is not None:
        record = {k: round(v, digits) if isinstance(v, float) else v for k, v in record.items()}
    line = json.dumps(record)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")
