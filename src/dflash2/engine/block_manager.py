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
