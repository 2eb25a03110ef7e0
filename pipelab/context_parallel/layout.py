"""Which tokens of the sequence each rank holds: contiguous shards, or zig-zag chunks.

Under a causal mask a query sees only the keys before it. With contiguous shards, rank 0's queries
see one block of keys (its own) and the last rank's see every block: the last rank works n times
as long as the first, and every ring step waits for it. Zig-zag cuts the sequence into 2n chunks
and gives rank r chunks r and 2n-1-r, one early and one late (Brandon et al., "Striped Attention",
2023; the Llama 3 paper; Megatron-LM's context parallelism): every rank then does the same work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LAYOUTS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class Layout:
    """`name` ("contiguous" or "zigzag") over `ranks` ranks."""

    name: str
    ranks: int

    @property
    def num_chunks(self) -> int:
        return self.ranks if self.name == "contiguous" else 2 * self.ranks

    def chunks(self, rank: int) -> tuple[int, ...]:
        """The chunk numbers rank `rank` holds, in the order it keeps them."""
        if self.name == "contiguous":
            return (rank,)
        return (rank, 2 * self.ranks - 1 - rank)

    def shard(self, x: torch.Tensor, rank: int, dim: int = 2) -> torch.Tensor:
        """Rank `rank`'s tokens of the whole sequence `x` (its chunks, concatenated along `dim`)."""
        pieces = x.chunk(self.num_chunks, dim)
        return torch.cat([pieces[c] for c in self.chunks(rank)], dim).contiguous()

    def unshard(self, shards: list[torch.Tensor], dim: int = 2) -> torch.Tensor:
        """The whole sequence back from every rank's shard."""
        pieces: dict[int, torch.Tensor] = {}
        for rank, shard in enumerate(shards):
            for c, piece in zip(self.chunks(rank), shard.chunk(len(self.chunks(rank)), dim)):
                pieces[c] = piece
        return torch.cat([pieces[c] for c in range(self.num_chunks)], dim)


def causal_pair(q_chunk: int, k_chunk: int, size: int) -> tuple[bool, torch.Tensor | None]:
    """Whether queries of chunk `q_chunk` see any key of chunk `k_chunk` under a causal mask, and
    the mask to apply: none when they see all of it, lower-triangular on the diagonal."""
    if q_chunk < k_chunk:
        return False, None  # every key is in the future: the block is skipped, no work
    if q_chunk > k_chunk:
        return True, None
    return True, torch.ones(size, size, dtype=torch.bool).tril()
