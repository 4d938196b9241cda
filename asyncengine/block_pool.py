"""The paged KV cache's bookkeeping: block ids, ref counts, the prefix cache and swap space.

This module decides which physical block holds which tokens; it moves no tensor data. Copies
it needs (copy-on-write, swap-out, swap-in) are returned as (src, dst) block pairs that the
model runner performs on the cache tensors before the step's forward pass.

Free blocks live in two O(1) structures: blocks holding no reusable prefix (handed out
first), and blocks that still hold a hashed prefix, kept in least-recently-freed order in an
OrderedDict so reviving a cached block or evicting the oldest one never scans a list.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from asyncengine.request import Request

_ROOT_HASH = 0x5EED


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Chained block hash: equal only if this block and every block before it are equal."""
    return hash((parent_hash, tuple(token_ids)))


class BlockPool:
    """GPU block allocator with ref counts, automatic prefix caching and copy-on-write."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        # Reversed so that pop() hands out low block ids first (pleasant in the dashboard).
        self._free_plain: list[int] = list(range(num_blocks - 1, -1, -1))
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # tokens found there

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------- allocation
    def _take_free_block(self) -> int:
        if self._free_plain:
            block = self._free_plain.pop()
        else:
            block, _ = self._free_cached.popitem(last=False)  # evict the least recently freed
            self._drop_hash(block)
        self.ref_counts[block] = 1
        return block

    def _drop_hash(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None and self.hash_to_block.get(h) == block:
            del self.hash_to_block[h]
        self.block_hash[block] = None
        self.block_tokens[block] = None

    def _ref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self._free_cached[block]  # a free block with a hash is always in the LRU
        self.ref_counts[block] += 1

    def _unref(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if self.block_hash[block] is not None:
                self._free_cached[block] = None
            else:
                self._free_plain.append(block)

    # ------------------------------------------------------------ prefix cache
    def compute_block_hashes(self, request: Request) -> list[int]:
        """Hashes of the request's full blocks of known tokens (extends its cached list)."""
        hashes = request.block_hashes
        tokens = request.all_token_ids
        bs = self.block_size
        for i in range(len(hashes), len(tokens) // bs):
            parent = hashes[i - 1] if i else _ROOT_HASH
            hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs]))
        return hashes

    def find_cached_blocks(self, request: Request) -> list[int]:
        """Longest chain of cached blocks for a request that has computed nothing yet.

        The last known token is never taken from the cache: its logits are needed.
        """
        if not self.enable_prefix_caching:
            return []
        hashes = self.compute_block_hashes(request)
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        found: list[int] = []
        for i in range(max_blocks):
            block = self.hash_to_block.get(hashes[i])
            if block is None or self.block_tokens[block] != tuple(
                request.all_token_ids[i * bs : (i + 1) * bs]
            ):
                break
            found.append(block)
        return found

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's newly computed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        # Tokens still in flight have K/V (or will) but no id yet: they cannot be hashed.
        known = min(request.num_computed_tokens, request.num_tokens)
        num_full = min(known // self.block_size, len(request.block_table))
        if num_full <= request.num_hashed_blocks:
            return
        hashes = self.compute_block_hashes(request)
        bs = self.block_size
        for i in range(request.num_hashed_blocks, num_full):
            block = request.block_table[i]
            h = hashes[i]
            if self.block_hash[block] is None and h not in self.hash_to_block:
                self.block_hash[block] = h
                self.block_tokens[block] = tuple(request.all_token_ids[i * bs : (i + 1) * bs])
                self.hash_to_block[h] = block
        request.num_hashed_blocks = num_full

    # ---------------------------------------------------------- request blocks
    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached_blocks: Sequence[int] = ()
    ) -> list[tuple[int, int]] | None:
        """Give the request room for `num_new_tokens` more computed tokens.

        `cached_blocks` (prefix-cache hits, only for a request with no blocks yet) are
        shared. Returns copy-on-write pairs (src, dst) to perform, or None (nothing changed)
        when the pool is short of blocks.
        """
        table = request.block_table
        if cached_blocks and table:
            raise ValueError("prefix-cache blocks can only start an empty block table")
        total = request.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        need = self.blocks_needed(total) - len(table) - len(cached_blocks)
        # A cached hit on a free block takes it out of the free pool too.
        revive = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)
        cow = self._needs_copy_on_write(request)
        if max(need, 0) + revive + cow > self.num_free_blocks:
            return None
        for block in cached_blocks:
            self._ref(block)
            table.append(block)
        if cached_blocks:
            request.num_computed_tokens += len(cached_blocks) * self.block_size
            request.num_hashed_blocks = len(cached_blocks)
        copies: list[tuple[int, int]] = []
        if cow:
            last = len(table) - 1
            src, dst = table[last], self._take_free_block()
            self._unref(src)
            table[last] = dst
            copies.append((src, dst))
        for _ in range(max(need, 0)):
            table.append(self._take_free_block())
        return copies

    def _needs_copy_on_write(self, request: Request) -> bool:
        """True if the next token lands in a partial block that others also reference."""
        table = request.block_table
        offset = request.num_computed_tokens % self.block_size
        if not table or offset == 0 or request.num_computed_tokens // self.block_size >= len(table):
            return False
        return self.ref_counts[table[request.num_computed_tokens // self.block_size]] > 1

    def fork(self, parent: Request, child: Request) -> None:
        """Share all of parent's blocks with child (parallel sampling); writes copy on write."""
        for block in parent.block_table:
            self._ref(block)
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_hashed_blocks = parent.num_hashed_blocks

    def free(self, request: Request) -> None:
        # Tail blocks go to the LRU first, so a prefix's head outlives its tail.
        for block in reversed(request.block_table):
            self._unref(block)
        request.block_table = []
        request.num_hashed_blocks = 0

    # ---------------------------------------------------------------- checks
    def check_integrity(self, holders: Iterable[Request]) -> None:
        """Every invariant of the pool; `holders` are all requests that may hold blocks."""
        refs = [0] * self.num_blocks
        for req in holders:
            assert len(set(req.block_table)) == len(req.block_table), (
                f"{req.request_id} lists a block twice"
            )
            for block in req.block_table:
                refs[block] += 1
        assert refs == self.ref_counts, "ref counts differ from block-table references"
        free_plain, free_cached = set(self._free_plain), set(self._free_cached)
        assert len(free_plain) == len(self._free_plain), "a block is free twice"
        assert not free_plain & free_cached, "a block is in both free lists"
        for block in range(self.num_blocks):
            is_free = block in free_plain or block in free_cached
            assert is_free != (self.ref_counts[block] > 0), f"block {block} free and referenced"
            if block in free_plain:
                assert self.block_hash[block] is None, f"plain free block {block} has a hash"
            if block in free_cached:
                assert self.block_hash[block] is not None, f"cached block {block} has no hash"
        for h, block in self.hash_to_block.items():
            assert self.block_hash[block] == h, f"hash map points to block {block} wrongly"
        for block, h in enumerate(self.block_hash):
            if h is not None:
                assert self.hash_to_block.get(h) == block, f"block {block} hash not in the map"
                assert self.block_tokens[block] is not None


class SwapSpace:
    """CPU blocks holding swapped-out requests' KV (a plain free list; no sharing)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self.tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def swap_out(self, pool: BlockPool, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to CPU; returns (gpu, cpu) copies, or None if full."""
        n = len(request.block_table)
        if n > len(self._free):
            return None
        cpu_blocks = [self._free.pop() for _ in range(n)]
        pairs = list(zip(request.block_table, cpu_blocks, strict=True))
        self.tables[request.request_id] = cpu_blocks
        pool.free(request)
        return pairs

    def can_swap_in(self, pool: BlockPool, request: Request) -> bool:
        # One extra block of headroom for the token that the next step appends.
        return len(self.tables[request.request_id]) + 1 <= pool.num_free_blocks

    def swap_in(self, pool: BlockPool, request: Request) -> list[tuple[int, int]]:
        """Bring the request's blocks back; returns (cpu, gpu) copies."""
        cpu_blocks = self.tables.pop(request.request_id)
        gpu_blocks = [pool._take_free_block() for _ in cpu_blocks]
        request.block_table = gpu_blocks
        request.num_hashed_blocks = 0
        self._free.extend(reversed(cpu_blocks))
        return list(zip(cpu_blocks, gpu_blocks, strict=True))

    def discard(self, request: Request) -> None:
        self._free.extend(reversed(self.tables.pop(request.request_id, [])))

    def check_integrity(self) -> None:
        held = [b for t in self.tables.values() for b in t]
        assert len(set(held)) == len(held), "a CPU block is held twice"
        assert not set(held) & set(self._free), "a CPU block is both free and held"
        assert len(held) + len(self._free) == self.num_blocks, "CPU blocks leaked"
