"""Continuous batching: admit waiting requests as others finish, preempt the newest when the
KV pool runs out (recompute preemption: it is requeued and re-prefilled later). The KV is the
runner's (:class:`.steps.KVManager`): pages of the paged runner's pool, or the static runner's slots."""

from __future__ import annotations

from collections import deque
from typing import Callable

from .steps import KVManager
from .request import Request, Status


class Scheduler:
    def __init__(self, bm: KVManager, max_running: int, width: int):
        self.bm, self.max_running, self.width = bm, max_running, width
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def admit(self, speculate: Callable[[int], bool] | None = None) -> list[Request]:
        """Requests to prefill now (their blocks are reserved for the prefill plus one step).
        ``speculate(n)``: whether a new request that makes ``n`` running ones drafts (asked once, at
        its first admission; a preempted request keeps its answer)."""
        admitted = []
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            if speculate is not None and not req.output_ids and not req.num_preemptions:
                req.speculate = speculate(len(self.running) + 1)
            need = req.num_tokens + self.lookahead(req)
            if not self.bm.can_grow(req, need):
                break
            self.waiting.popleft()
            self.bm.grow(req, need)
            req.status = Status.RUNNING
            self.running.append(req)
            admitted.append(req)
        return admitted

    def fits(self, req: Request) -> bool:
        """Whether ``req``'s prefill and first step fit the KV memory as it is now."""
        return self.bm.can_grow(req, req.num_tokens + self.lookahead(req))

    def lookahead(self, req: Request) -> int:
        """KV positions past the committed ones that its next step may write: a block, or one token for
        a request that does not draft."""
        return self.width if req.speculate else 1

    def can_reserve(self, extra: int) -> bool:
        """Whether :meth:`reserve_step` with ``extra`` fits without preempting."""
        return all(self.bm.can_grow(r, r.num_committed + self.lookahead(r) + extra) for r in self.running)

    def reserve_step(self, extra: int = 0) -> list[Request]:
        """Blocks for one verify step of every running request (and ``extra`` positions more: a step in
        flight, whose tokens the host's lengths do not count yet); preempts the newest as needed.
        Returns the preempted requests."""
        preempted: list[Request] = []
        for req in list(self.running):
            if preempted and req not in self.running:  # (a membership test only once one is out: O(N) each)
                continue
            need = req.num_committed + self.lookahead(req) + extra
            while not self.bm.can_grow(req, need):
                victim = self.running[-1]
                self.running.remove(victim)
                self.bm.release(victim)
                victim.status = Status.WAITING
                victim.num_preemptions += 1
                self.waiting.appendleft(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if not preempted or req in self.running:
                self.bm.grow(req, need)
        return preempted

    def finish(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.bm.release(req)
        req.status = Status.FINISHED
