"""Paged KV-cache bookkeeping: fixed-size blocks, a block table per sequence, reference counts and
prefix caching.

A block is `block_size` token slots of every layer's K and V (the tensors live in
models.kv_cache.PagedKVCache; this module only hands out block ids). A full block is known by the
hash of its tokens chained with the previous block's hash, so sequences that share a prefix share
its blocks (reference counted) and a later one skips that part of prefill. A block is registered
only after its keys and values were computed. A freed block keeps its hash until it is handed out
again, so a later request can still hit it; free blocks are reused least recently freed first.
"""
from collections import OrderedDict
from dataclasses import dataclass

from attention_nodes.sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    """KV blocks that hold num_tokens tokens."""
    return -(-num_tokens // block_size)


@dataclass
class Block:
    id: int
    ref_count: int = 0
    hash: int | None = None
    tokens: tuple[int, ...] = ()  # checked on a hit, so a hash collision can never share wrong blocks


class BlockManager:
    """KV blocks, shared through the prefix cache, and (state_slots > 0: models with linear-attention
    layers) the slots of their per-sequence states, one per running sequence: taken on admission,
    given back with the blocks (finished, aborted or preempted)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, state_slots: int = 0):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one KV block of at least one token, got {num_blocks} x {block_size}")
        self.block_size, self.enable_prefix_caching = block_size, enable_prefix_caching
        self.num_state_slots = state_slots
        self.free_state_slots = list(range(state_slots - 1, -1, -1))  # popped from the end: 0 first
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found (prefill skipped)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of seq's tokens (full blocks only, and never
        all of them: the last token must be computed to get its logits). No side effects. None for
        a sequence that needs its prompt's logprobs: those come from computing every position."""
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs:
            return []
        hits, h, bs = [], None, self.block_size
        for i in range((seq.num_tokens - 1) // bs):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = hash((h, tokens))
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].tokens != tokens:
                break
            hits.append(block_id)
        return hits

    def blocks_needed(self, seq: Sequence, num_tokens: int, prefix: list[int] = ()) -> int:
        """Free blocks taken if seq (with the prefix blocks `prefix` shared in) grows to num_tokens."""
        revived = sum(1 for b in prefix if self.blocks[b].ref_count == 0)  # cached but on the free list
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table) - len(prefix)) + revived

    def share_prefix(self, seq: Sequence, prefix: list[int]) -> None:
        """Give an empty sequence the cached blocks of its prefix; they count as computed."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        for b in prefix:
            block = self.blocks[b]
            if block.ref_count == 0:
                del self.free[b]
            block.ref_count += 1
        seq.block_table = list(prefix)
        seq.num_hashed_blocks = len(prefix)
        seq.num_computed_tokens = len(prefix) * self.block_size
        seq.last_block_hash = self.blocks[prefix[-1]].hash if prefix else None

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Append free blocks to seq's table until it holds num_tokens tokens."""
        for _ in range(self.blocks_for(num_tokens) - len(seq.block_table)):
            b, _ = self.free.popitem(last=False)
            block = self.blocks[b]
            if block.hash is not None and self.cached.get(block.hash) == b:
                del self.cached[block.hash]  # evicted from the prefix cache
            block.hash, block.tokens, block.ref_count = None, (), 1
            seq.block_table.append(b)

    def register_computed(self, seq: Sequence) -> None:
        """Enter seq's newly computed full blocks into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(seq.num_hashed_blocks, seq.num_computed_tokens // bs):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = hash((seq.last_block_hash, tokens))
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self.cached:
                block.hash, block.tokens = h, tokens
                self.cached[h] = block.id
            seq.last_block_hash, seq.num_hashed_blocks = h, i + 1

    def free_sequence(self, seq: Sequence) -> None:
        """Drop seq's references; blocks nobody holds go back to the free list (tail blocks first,
        so the shareable head of a prefix stays cached longest)."""
        for b in reversed(seq.block_table):
            block = self.blocks[b]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {b} freed twice"
            if block.ref_count == 0:
                self.free[b] = None
        seq.block_table, seq.num_computed_tokens = [], 0
        seq.draft_pos = 0  # (a draft model's keys and values go with the blocks)
        seq.num_hashed_blocks, seq.last_block_hash = 0, None
        if seq.state_slot is not None:
            self.free_state_slots.append(seq.state_slot)
            seq.state_slot = None

    def take_state_slot(self, seq: Sequence) -> None:
        """Give an admitted sequence a state slot (models with linear-attention layers; the scheduler
        runs at most as many sequences as there are slots)."""
        if self.free_state_slots and seq.state_slot is None:
            seq.state_slot = self.free_state_slots.pop()
