"""The examples of docs/dsa.md run as written (its python blocks, in order, in one namespace)."""
import pathlib
import re

import torch

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "dsa.md"


def test_docs_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 2
    namespace = {}
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), namespace)
    layer = namespace["layer"]
    grads = [p.grad for p in layer.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    # the indexer's projections learned from the loss, the attention's from y
    assert namespace["indexer_loss"].item() > 0
    assert namespace["y"].shape == (40, 64)
