"""A transport restricted to a subset of a group's ranks (a rail group, a node), without a new process group.

Two-level algorithms run an ordinary flat algorithm (ring, direct, ...) among, say, the ranks of one rail;
``SubTransport(parent, members)`` presents those ranks as 0..len(members)-1 and forwards to ``parent``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hpdl.comm.transport.base import TAG_MAX, Request, Transport, check_int


class SubTransport(Transport):
    """View of ``parent`` limited to ``members`` (ranks of the parent, in the order that defines sub-ranks).

    Args:
        parent: the group's transport.
        members: distinct parent ranks, including ``parent.rank``.
        tag_offset: added to every tag, so that several sub-groups sharing a pair of ranks never match each
            other's messages.

    Raises:
        ValueError: ``members`` has duplicates, ranks out of range, or does not contain this rank.
    """

    def __init__(self, parent: Transport, members: Sequence[int], tag_offset: int = 0):
        members = [int(m) for m in members]
        if len(set(members)) != len(members) or any(not 0 <= m < parent.world_size for m in members):
            raise ValueError(f"members must be distinct ranks in [0, {parent.world_size}), got {members}")
        if parent.rank not in members:
            raise ValueError(f"members {members} must include this rank ({parent.rank})")
        self.parent, self.members, self.tag_offset = parent, members, int(tag_offset)
        self.rank = members.index(parent.rank)
        self.world_size = len(members)
        self.device = parent.device

    @property
    def timeout(self) -> float:  # type: ignore[override]
        return self.parent.timeout

    def post(self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]],
             tag: int = 0) -> tuple[list[Request], list[Request]]:
        m = self.members
        # sub-ranks and the tag before its offset checked here (the parent checks tensors and the sum)
        tag = check_int("tag", tag, 0, TAG_MAX)
        sends = [(t, check_int("send peer", q, 0, len(m) - 1, f"a rank in [0, {len(m)})")) for t, q in sends]
        recvs = [(t, check_int("recv peer", q, 0, len(m) - 1, f"a rank in [0, {len(m)})")) for t, q in recvs]
        return self.parent.post([(t, m[q]) for t, q in sends], [(t, m[q]) for t, q in recvs], tag + self.tag_offset)

    def describe(self, peer: int) -> str:
        return self.parent.describe(self.members[peer])

    def explain(self, peer: int) -> str | None:
        return self.parent.explain(self.members[peer])
