"""Paged KV memory: fixed-size blocks, per-request block tables, a free list."""

from __future__ import annotations

from .request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def capacity(self) -> int:
        """The most positions one request can hold: the whole pool."""
        return self.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_grow(self, req: Request, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(req.block_table) <= self.num_free

    def grow(self, req: Request, num_tokens: int) -> None:
        """Make ``req``'s table cover ``num_tokens`` tokens."""
        need = self.blocks_for(num_tokens) - len(req.block_table)
        if need > self.num_free:
            raise MemoryError(f"KV pool exhausted: need {need} blocks, {self.num_free} free")
        for _ in range(max(need, 0)):
            req.block_table.append(self.free.pop())

    def release(self, req: Request) -> None:
        self.free.extend(reversed(req.block_table))
        req.block_table = []


class SlotManager:
    """The static-slot runner's KV as the scheduler sees it: one slot of ``max_len`` positions per
    running request (``block_size`` = positions of a slot), so admission counts slots, not pages."""

    def __init__(self, num_slots: int, max_len: int):
        self.num_blocks, self.block_size = num_slots, max_len
        self.used = 0

    @property
    def num_free(self) -> int:
        return self.num_blocks - self.used

    @property
    def capacity(self) -> int:
        return self.block_size  # one request holds one slot at most

    def can_grow(self, req: Request, num_tokens: int) -> bool:
        return num_tokens <= self.block_size and (bool(req.block_table) or self.num_free > 0)

    def grow(self, req: Request, num_tokens: int) -> None:
        if not self.can_grow(req, num_tokens):
            raise MemoryError(
                f"no slot for {num_tokens} positions ({self.num_free} of {self.num_blocks} free, "
                f"{self.block_size} positions each)"
            )
        if not req.block_table:
            req.block_table, self.used = [0], self.used + 1  # the slot itself is the runner's (req.slot)

    def release(self, req: Request) -> None:
        if req.block_table:
            self.used -= 1
        req.block_table = []
