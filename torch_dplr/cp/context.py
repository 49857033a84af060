"""``build_context``: a process group and the global packed layout, planned for this rank."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from ..reference.layout import check_cu_seqlens_values
from .plan import RankPlan, carries_in, even_shares, plan_rank


@dataclass(frozen=True)
class LocalTensors:
    """This rank's plan as tensors on its device, built once per context: a call reads them
    without host work, and a compiled graph sees tensors (symbolic sizes) rather than ints."""
    cu_seqlens: torch.Tensor          # offsets of the rank's pieces
    cu_seqlens_cpu: torch.Tensor
    carry_cu_seqlens: torch.Tensor    # the same, with the carry-in piece appended once more
    carry_cu_seqlens_cpu: torch.Tensor
    carry_tokens: torch.Tensor        # [L] (values unused): L, the carry-in piece's length
    initial_index: torch.Tensor       # per piece: global initial-state row (0 where masked)
    initial_mask: torch.Tensor        # per piece: 1 where that row applies, else 0
    final_index: torch.Tensor         # per global sequence: row of [piece ends, carry end]
    final_mask: torch.Tensor          # per global sequence: 1 where it ends on this rank
    record_piece: torch.Tensor        # [1]: the piece whose end state is the record's offset
    record_offset_mask: torch.Tensor  # [1]: 0 when the record's offset is zero
    record_map: torch.Tensor          # [1]: the record's transition: 0 zero, 1 identity, 2 carried


@dataclass(frozen=True, eq=False)
class CPContext:
    """What ``chunk_dplr_delta_rule(..., cp_context=ctx)`` needs to know about the split.

    Build it with :func:`build_context`.  ``token_range`` is this rank's share ``[start, end)``
    of the packed tokens (:meth:`shard` slices a global ``[1, T, ...]`` tensor to it);
    ``initial_state_rows`` / ``final_state_rows`` the sequences whose initial state it
    applies and whose final state it returns.
    """
    group: dist.ProcessGroup
    group_name: str
    rank: int
    world_size: int
    device: torch.device
    cu_seqlens: tuple[int, ...]
    shares: tuple[int, ...]
    needs_exchange: bool            # some rank continues a sequence from an earlier one
    plan: RankPlan
    local: LocalTensors = field(repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.cu_seqlens) - 1

    @property
    def num_tokens(self) -> int:
        return self.cu_seqlens[-1]

    @property
    def token_range(self) -> tuple[int, int]:
        return self.plan.token_range

    @property
    def initial_state_rows(self) -> tuple[int, ...]:
        return self.plan.initial_state_rows

    @property
    def final_state_rows(self) -> tuple[int, ...]:
        return self.plan.final_state_rows

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of a global ``[1, T, ...]`` tensor (a view)."""
        start, end = self.token_range
        return x[:, start:end]


def _default_device(group) -> torch.device:
    if "nccl" in str(dist.get_backend(group)).lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _as_layout(cu_seqlens) -> tuple[int, ...]:
    if isinstance(cu_seqlens, bool):
        raise TypeError("cu_seqlens must be an int (one sequence's length), a sequence of ints "
                        "or a 1-D integer tensor, got bool")
    if isinstance(cu_seqlens, int):
        if cu_seqlens < 0:
            raise ValueError(f"the sequence length must be >= 0, got {cu_seqlens}")
        return (0, cu_seqlens)
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1:
            raise TypeError(f"cu_seqlens must be a 1-D int32/int64 tensor, got {cu_seqlens.dtype} "
                            f"with shape {tuple(cu_seqlens.shape)}")
        values = tuple(cu_seqlens.tolist())
    elif isinstance(cu_seqlens, Sequence) and all(
            isinstance(x, int) and not isinstance(x, bool) for x in cu_seqlens):
        values = tuple(cu_seqlens)
    else:
        raise TypeError("cu_seqlens must be an int (one sequence's length), a sequence of ints "
                        f"or a 1-D integer tensor, got {type(cu_seqlens).__name__}")
    if len(values) < 2:
        raise ValueError(f"cu_seqlens must have N+1 >= 2 entries, got {list(values)}")
    check_cu_seqlens_values(values, values[-1])
    return values


def _as_shares(shares, num_tokens, world_size) -> tuple[int, ...]:
    if shares is None:
        return even_shares(num_tokens, world_size)
    if not isinstance(shares, Sequence) or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in shares):
        raise TypeError(f"shares must be a sequence of ints, got {shares!r}")
    if len(shares) != world_size:
        raise ValueError(f"shares must give one token count per rank of the group "
                         f"({world_size} ranks), got {len(shares)}: {list(shares)}")
    if any(x < 0 for x in shares):
        raise ValueError(f"shares must be >= 0, got {list(shares)}")
    if sum(shares) != num_tokens:
        raise ValueError(f"shares must add up to the token count {num_tokens} of cu_seqlens, "
                         f"got {list(shares)} (sum {sum(shares)})")
    return tuple(shares)


def _digest(values) -> int:
    return int.from_bytes(hashlib.sha256(repr(tuple(values)).encode()).digest()[:7], "little")


def _check_ranks_agree(group, device, world_size, cu, shares):
    """The one collective of ``build_context``: every rank compares the layout it was given
    with every other rank's, and all raise the same error when they differ."""
    mine = torch.tensor([_digest(cu), _digest(shares)], dtype=torch.int64, device=device)
    every = mine.new_empty(world_size * 2)
    dist.all_gather_into_tensor(every, mine, group=group)
    every = every.view(world_size, 2).tolist()
    for column, name in ((0, "cu_seqlens"), (1, "shares")):
        differ = [r for r in range(world_size) if every[r][column] != every[0][column]]
        if differ:
            raise ValueError(f"the ranks of the group disagree on {name}: ranks {differ} were "
                             f"given another {name} than rank 0 (every rank must pass the same "
                             f"global layout)")


def _local_tensors(plan: RankPlan, device) -> LocalTensors:
    def make(values, dtype=torch.int64, on=device):
        return torch.tensor(values, dtype=dtype, device=on)

    cu = plan.local_cu_seqlens
    carry_cu = cu + (cu[-1] + plan.carry_in,)
    initial = plan.initial_rows
    final = plan.final_sources
    state_mask = torch.float64  # exact 0/1, cast to the state dtype at use
    local = LocalTensors(
        cu_seqlens=make(cu), cu_seqlens_cpu=make(cu, on="cpu"),
        carry_cu_seqlens=make(carry_cu), carry_cu_seqlens_cpu=make(carry_cu, on="cpu"),
        carry_tokens=torch.empty(plan.carry_in, dtype=torch.int8, device=device),
        initial_index=make([max(i, 0) for i in initial]),
        initial_mask=make([float(i >= 0) for i in initial], state_mask),
        final_index=make([max(i, 0) for i in final]),
        final_mask=make([float(i >= 0) for i in final], state_mask),
        record_piece=make([max(plan.record_piece, 0)]),
        record_offset_mask=make([float(plan.record in ("reset", "through"))], state_mask),
        record_map=make([{"identity": 1, "through": 2}.get(plan.record, 0)]),
    )
    # sizes that change with the layout stay symbolic in compiled graphs
    for t in (local.cu_seqlens, local.carry_cu_seqlens, local.carry_tokens, local.initial_index,
              local.initial_mask, local.final_index, local.final_mask):
        torch._dynamo.maybe_mark_dynamic(t, 0)
    return local


def build_context(group=None, cu_seqlens=None, *, shares=None, device=None) -> CPContext:
    """A context-parallel layout for this rank.

    Args:
        group: the ``torch.distributed`` process group whose ranks split the tokens (default:
            the world).  Every rank of the group calls this with the same arguments.
        cu_seqlens: the global layout: ``[N+1]`` offsets of the packed sequences (a 1-D
            integer tensor or a sequence of ints), or an int, the length of one sequence.
        shares: tokens per rank, in group order (default: as even as possible, the longer
            shares first).  Any lengths, zero included; they must add up to the token count.
        device: the device of the tensors the ranks will pass (default: the current CUDA
            device for an NCCL group, else the CPU).

    Every rank then passes its share -- global tokens ``[start, end)`` of
    ``ctx.token_range`` -- as ``[1, T_rank, H, D]`` tensors with ``cp_context=ctx``.
    Argument errors are raised before any communication; then one all-gather of a digest of
    the layout checks that the ranks agree (every rank raises if they do not).  A tensor
    ``cu_seqlens`` is read on the host once, here.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("build_context needs an initialized torch.distributed process group")
    group = dist.group.WORLD if group is None else group
    if group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group gives a non-member
        raise ValueError("this process is not a member of the given process group")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup, "
                        f"got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the given process group")
    world_size = dist.get_world_size(group)
    if cu_seqlens is None:
        raise TypeError("build_context() needs cu_seqlens (or one sequence's length)")
    cu = _as_layout(cu_seqlens)
    shares = _as_shares(shares, cu[-1], world_size)
    device = _default_device(group) if device is None else torch.device(device)
    _check_ranks_agree(group, device, world_size, cu, shares)
    plan = plan_rank(cu, shares, rank)
    needs_exchange = any(carries_in(cu, shares, r) for r in range(world_size))
    return CPContext(group, group.group_name, rank, world_size, device, cu, shares,
                     needs_exchange, plan, _local_tensors(plan, device))
