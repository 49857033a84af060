"""Selective-activation-checkpoint policies over one family of custom ops (``dplr``, ``dsa``).

A :class:`PolicySet` names the family's differentiable forward ops and its shipped policies
(each the set of forward ops whose outputs are kept); every other forward op of the family in
a checkpointed region is recomputed in the backward, and ops of other namespaces are
recomputed unless listed in ``extra_save_ops``.  The families' ``policies`` modules expose one
set each.
"""
from __future__ import annotations

import functools
from typing import Callable, Iterable

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts


class PolicySet:
    def __init__(self, namespace: str, forward_ops: frozenset, policies: dict,
                 always_saved: frozenset = frozenset(), example: str = ""):
        self.namespace = namespace
        self.forward_ops = forward_ops
        self.policies = policies
        self.always_saved = always_saved
        self._example = example or f"torch.ops.{namespace}.<op>"

    def as_overload(self, op):
        """``torch.ops.ns.x``, ``torch.ops.ns.x.default`` or ``"ns::x"`` -> the overload."""
        if isinstance(op, str):
            namespace, _, name = op.rpartition("::")
            try:
                op = getattr(getattr(torch.ops, namespace or self.namespace), name)
            except AttributeError:
                raise ValueError(f"unknown op {op!r} in a checkpoint policy") from None
        if isinstance(op, torch._ops.OpOverloadPacket):
            op = op.default
        if not isinstance(op, torch._ops.OpOverload):
            raise TypeError(f"checkpoint policies take ops (e.g. {self._example}), "
                            f"got {type(op).__name__}")
        return op

    def resolve(self, policy) -> frozenset:
        """The forward ops a policy (a name, or an iterable of ops) keeps."""
        if isinstance(policy, str):
            if policy not in self.policies:
                raise ValueError(f"policy must be one of {sorted(self.policies)} or a set of "
                                 f"ops, got {policy!r}")
            return self.policies[policy]
        return frozenset(map(self.as_overload, policy))

    def recomputed_ops(self, policy) -> frozenset:
        """The family's forward ops a policy recomputes in the backward."""
        return self.forward_ops - self.resolve(policy)

    def policy_fn(self, policy, extra_save_ops: Iterable = ()) -> Callable:
        """The per-op decision function for ``create_selective_checkpoint_contexts``."""
        save = (self.resolve(policy) | self.always_saved
                | frozenset(map(self.as_overload, extra_save_ops)))
        forward_ops = self.forward_ops

        def decide(ctx, op, *args, **kwargs):
            if op in save:
                return CheckpointPolicy.MUST_SAVE
            if op in forward_ops:
                # forced: the min-cut partitioner would otherwise keep custom-op outputs
                return CheckpointPolicy.MUST_RECOMPUTE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return decide

    def context_fn(self, policy, extra_save_ops: Iterable = ()) -> Callable:
        """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``."""
        return functools.partial(create_selective_checkpoint_contexts,
                                 self.policy_fn(policy, extra_save_ops))
