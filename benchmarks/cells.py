"""The benchmark envelope of issue 4, as a list of cells.

A cell is one (shape, chunk size, gate style, state, mode, policy).  Forward cells run without
grad (``policy`` "none": nothing is kept for a backward).  Forward+backward cells come twice:
``policy`` "none" (torch_dplr without checkpointing against FLA's ``disable_recompute=True``,
both keep intermediates) and the shipped recompute policy (torch_dplr under
``torch.utils.checkpoint`` with that policy against FLA's default, both recompute).

With ``stages`` every (shape, chunk size, gate style, state) also gets a ``stage`` cell: the
stage ops timed one by one (:mod:`benchmarks.stages`).

Cell ids read like ``B8-T4096-H32-D64/c64/rwkv7/state/fwd_bwd/save_state`` (a stage cell:
``B8-T4096-H32-D64/c64/rwkv7/state/stage``); ``--cells`` filters them with a regular expression.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Iterable

# README.md's checkpoint example uses it, and policies.py calls it FLA's default trade.
SHIPPED_POLICY = "save_state"

MODES = ("fwd", "fwd_bwd")
FIRST_CALL = "first_call"
STAGE = "stage"  # the per-stage breakdown of a cell (benchmarks.stages)
# Gate styles with the chunk sizes each is timed at (the issue adds unbounded gates at 16 and 32).
GATE_CHUNKS = {"rwkv7": (16, 32, 64), "unbounded": (16, 32)}
STATES = (False, True)


@dataclasses.dataclass(frozen=True)
class Shape:
    """``N`` sequences packed into ``B == 1`` rows of ``T`` tokens when ``N`` is set (varlen)."""

    B: int
    T: int
    H: int
    D: int
    N: int | None = None

    @property
    def label(self) -> str:
        seqs = f"-N{self.N}" if self.N is not None else ""
        return f"B{self.B}-T{self.T}{seqs}-H{self.H}-D{self.D}"

    @property
    def num_states(self) -> int:
        return self.N if self.N is not None else self.B


DESIGN = Shape(8, 4096, 32, 64)
SHAPES = (
    DESIGN,
    Shape(4, 4096, 32, 128),
    Shape(2, 4096, 8, 64),  # small grid
    Shape(1, 65536, 32, 64),  # long
    Shape(1, 32768, 32, 64, N=8),
    Shape(1, 32768, 32, 64, N=64),
)


def tiny(shape: Shape) -> Shape:
    """The same layout at a size a CPU runs in a second or less (smoke tests); tiny shapes of
    different envelope shapes stay different."""
    return Shape(min(shape.B, 2), min(shape.T // 32, 512), max(1, shape.H // 16), shape.D, shape.N)


@dataclasses.dataclass(frozen=True)
class Cell:
    shape: Shape
    chunk_size: int
    gates: str
    state: bool
    mode: str
    policy: str = "none"

    @property
    def id(self) -> str:
        state = "state" if self.state else "nostate"
        head = f"{self.shape.label}/c{self.chunk_size}/{self.gates}/{state}/{self.mode}"
        return head if self.mode == STAGE else f"{head}/{self.policy}"

    def fields(self) -> dict:
        """The identifying JSON fields of the cell's record."""
        s = self.shape
        return {"cell": self.id, "B": s.B, "T": s.T, "H": s.H, "D": s.D, "N": s.N,
                "chunk_size": self.chunk_size, "gates": self.gates, "state": self.state,
                "mode": self.mode, "policy": self.policy}


def _cells_of(shape: Shape, chunks_by_gate: dict, policies: Iterable[str], stages: bool) -> list[Cell]:
    cells = []
    for gates, chunks in chunks_by_gate.items():
        for chunk in chunks:
            for state in STATES:
                cells.append(Cell(shape, chunk, gates, state, "fwd"))
                cells.extend(Cell(shape, chunk, gates, state, "fwd_bwd", p) for p in policies)
                if stages:
                    cells.append(Cell(shape, chunk, gates, state, STAGE))
    return cells


def envelope(policies=("none", SHIPPED_POLICY), quick=False, shrink=False, stages=False) -> list[Cell]:
    """Every cell of issue 4's envelope; ``quick``: the design shape at chunk 64, RWKV-7 gates;
    ``stages``: with a stage cell per (shape, chunk size, gate style, state)."""
    shapes = (DESIGN,) if quick else SHAPES
    chunks = {"rwkv7": (64,)} if quick else GATE_CHUNKS
    if shrink:
        shapes = tuple(tiny(s) for s in shapes)
    return [c for s in shapes for c in _cells_of(s, chunks, policies, stages)]


def select(cells: list[Cell], pattern: str | None, modes: Iterable[str]) -> list[Cell]:
    """Cells whose mode is in ``modes`` and whose id matches ``pattern`` (``re.search``)."""
    regex = re.compile(pattern) if pattern else None
    modes = set(modes)
    return [c for c in cells if c.mode in modes and (regex is None or regex.search(c.id))]


def _weight(cell: Cell) -> float:
    """Roughly how long a cell takes: its data size, twice for a backward, more for small chunks."""
    s = cell.shape
    return s.B * s.T * s.H * s.D * (1 if cell.mode == "fwd" else 2) * (64 / cell.chunk_size) ** 0.5


def shard(cells: list[Cell], index: int, count: int) -> list[Cell]:
    """The cells of shard ``index`` of ``count``: whole (shape, gate style, chunk size) units
    (they share inputs and FLA's autotuning), dealt out longest first to the lightest shard,
    so that ``count`` processes (one per GPU) finish at about the same time.  The shards are
    disjoint and together hold every cell, in their original order."""
    if not 0 <= index < count:
        raise ValueError(f"shard index must be in [0, {count}), got {index}")
    units: dict[tuple, float] = {}
    for c in cells:
        unit = (c.shape, c.gates, c.chunk_size)
        units[unit] = units.get(unit, 0.0) + _weight(c)
    loads, owner = [0.0] * count, {}
    for unit, weight in sorted(units.items(), key=lambda kv: -kv[1]):
        lightest = loads.index(min(loads))
        owner[unit] = lightest
        loads[lightest] += weight
    return [c for c in cells if owner[(c.shape, c.gates, c.chunk_size)] == index]


def first_call_shape(shrink=False) -> Shape:
    return tiny(DESIGN) if shrink else DESIGN
