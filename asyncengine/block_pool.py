"""The paged KV cache's bookkeeping: block ids, ref counts, the prefix cache and swap space.

This module decides which physical block holds which tokens; it moves no tensor data. Copies
it needs (copy-on-write, swap-out, swap-in) are returned as (src, dst) block pairs that the
model runner performs on the cache tensors before the step's forward pass.

Free blocks live in two O(1) structures: blocks holding no reusable prefix (handed out
first), and blocks that still hold a hashed prefix, kept in least-recently-freed order in an
OrderedDict so reviving a cached block or evicting the oldest one never scans a list.

With a draft model every block also holds the draft's K/V (the model runner's
`draft_kv_cache`). A cached block serves the draft only when the draft ran over all its
positions while a request whose tokens give the block's hash held it (`draft_cached`): a
block cached by a request that never drafted, or before its draft caught up, holds none.
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
        # Hashed blocks whose draft-model K/V is there for all their positions too. Only ever
        # set on a hashed block, and cleared with its hash: the block is then reused (or
        # written by a sequence whose tokens differ) and its draft K/V goes with its target's.
        self.draft_cached: list[bool] = [False] * num_blocks
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

    def cached_free_blocks(self) -> Iterable[int]:
        """Free blocks still holding a reusable prefix (every free block with a hash),
        least recently freed first."""
        return self._free_cached.keys()

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------- allocation
    def take_free_block(self) -> int:
        """One block for a new owner (ref count 1): a plain free block, else the least
        recently freed cached one, whose hash is dropped."""
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
        self.draft_cached[block] = False

    def add_ref(self, block: int) -> None:
        """One more owner of `block` (a free cached block leaves the LRU)."""
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
                # The draft may have passed the block before its target K/V was complete.
                self.draft_cached[block] = request.num_draft_computed_tokens >= (i + 1) * bs
        request.num_hashed_blocks = num_full

    def cache_draft_blocks(self, request: Request, num_before: int) -> None:
        """The draft model has just computed the request's positions from `num_before` up to
        its `num_draft_computed_tokens`: the cached full blocks it passed hold the draft's
        K/V too. A block not cached yet is marked when `cache_full_blocks` registers it."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        end = min(request.num_draft_computed_tokens // bs, len(request.block_table))
        if end <= num_before // bs:
            return
        hashes = self.compute_block_hashes(request)
        for i in range(num_before // bs, min(end, len(hashes))):
            block = request.block_table[i]
            # Under the request's own hash only: its tokens are what the draft just ran over.
            if self.block_hash[block] == hashes[i]:
                self.draft_cached[block] = True

    def num_draft_cached_tokens(self, blocks: Sequence[int]) -> int:
        """Leading tokens of a chain of cached blocks whose draft K/V is there too."""
        n = 0
        while n < len(blocks) and self.draft_cached[blocks[n]]:
            n += 1
        return n * self.block_size

    def reset_prefix_cache(self) -> int:
        """Forget every free block's cached prefix (vLLM's `reset_prefix_cache`, the
        router's `/flush_cache`); returns how many blocks were dropped.

        Blocks that requests still hold keep their hashes: their contents are live and
        correct, and they join the cache as usual when freed. Only call between steps."""
        dropped = len(self._free_cached)
        for block in self._free_cached:
            self._drop_hash(block)
            self._free_plain.append(block)
        self._free_cached.clear()
        return dropped

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
        if not table:
            # A start on no blocks (admission, readmission): the draft's K/V is what the hit
            # brings, as far as each block has it, whatever the request held before.
            request.num_draft_computed_tokens = self.num_draft_cached_tokens(cached_blocks)
        for block in cached_blocks:
            self.add_ref(block)
            table.append(block)
        if cached_blocks:
            request.num_computed_tokens += len(cached_blocks) * self.block_size
            request.num_hashed_blocks = len(cached_blocks)
        copies: list[tuple[int, int]] = []
        write = request.num_computed_tokens // self.block_size
        if cow:
            src, dst = table[write], self.take_free_block()
            self._unref(src)
            table[write] = dst
            copies.append((src, dst))
        elif self._writes_into_hashed_block(request):
            # A sequence forked inside a full cached block, now its only holder: its own
            # tokens overwrite the block, which no longer holds what its hash says.
            self._drop_hash(table[write])
        for _ in range(max(need, 0)):
            table.append(self.take_free_block())
        return copies

    def _write_block(self, request: Request) -> int | None:
        """The block the next token lands in, when it is already partly computed."""
        table = request.block_table
        offset = request.num_computed_tokens % self.block_size
        index = request.num_computed_tokens // self.block_size
        if not table or offset == 0 or index >= len(table):
            return None
        return table[index]

    def _needs_copy_on_write(self, request: Request) -> bool:
        """True if the next token lands in a partial block that others also reference."""
        block = self._write_block(request)
        return block is not None and self.ref_counts[block] > 1

    def _writes_into_hashed_block(self, request: Request) -> bool:
        block = self._write_block(request)
        return block is not None and self.block_hash[block] is not None

    def fork(self, parent: Request, child: Request, num_tokens: int | None = None) -> None:
        """Share parent's blocks with child (parallel sampling); writes copy on write.

        With `num_tokens`, only the blocks holding parent's first `num_tokens` computed
        tokens are shared and the child has computed exactly those; by default all of them.
        """
        if child.block_table:
            raise ValueError(f"{child.request_id} already holds blocks")
        if num_tokens is None:
            num_tokens = parent.num_computed_tokens
        elif not 0 <= num_tokens <= parent.num_computed_tokens:
            raise ValueError(
                f"cannot fork {num_tokens} tokens: {parent.request_id} has computed "
                f"{parent.num_computed_tokens}"
            )
        shared = parent.block_table[: self.blocks_needed(num_tokens)]
        for block in shared:
            self.add_ref(block)
        child.block_table = list(shared)
        child.num_computed_tokens = num_tokens
        child.num_hashed_blocks = min(parent.num_hashed_blocks, num_tokens // self.block_size)
        # The shared positions hold the parent's draft K/V as far as its draft has run.
        child.num_draft_computed_tokens = min(parent.num_draft_computed_tokens, num_tokens)

    def free_tail(self, request: Request, num_tokens: int) -> None:
        """Free the request's blocks past those holding its first `num_tokens` tokens (the
        slots of rejected drafts). They were reserved in the step just verified: their own,
        never shared, never hashed."""
        keep = self.blocks_needed(num_tokens)
        table = request.block_table
        for block in reversed(table[keep:]):
            self._unref(block)
        del table[keep:]
        request.num_hashed_blocks = min(request.num_hashed_blocks, keep)

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
        first_holder: dict[int, tuple[Request, int]] = {}
        for req in holders:
            table = req.block_table
            assert len(set(table)) == len(table), f"{req.request_id} lists a block twice"
            for k, block in enumerate(table):
                refs[block] += 1
                seen = first_holder.setdefault(block, (req, k))
                if seen[0] is req:
                    continue
                # Sharing is always of a prefix (fork, prefix-cache hits), so a shared block
                # sits at one index in every table; a block reserved past a holder's
                # computed tokens is written next and must be its own.
                other, j = seen
                assert j == k, f"block {block} shared at table indexes {j} and {k}"
                for holder, idx in ((req, k), (other, j)):
                    assert idx < self.blocks_needed(holder.num_computed_tokens), (
                        f"block {block} is shared but {holder.request_id} writes into it next"
                    )
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
            if self.draft_cached[block]:
                assert self.block_hash[block] is not None, f"block {block} draft-cached, no hash"
        for h, block in self.hash_to_block.items():
            assert self.block_hash[block] == h, f"hash map points to block {block} wrongly"
        for block, h in enumerate(self.block_hash):
            if h is not None:
                assert self.hash_to_block.get(h) == block, f"block {block} hash not in the map"
                assert self.block_tokens[block] is not None


class SwapSpace:
    """CPU blocks holding swapped-out requests' KV.

    Sequences of one parallel request swapped out together keep sharing: a GPU block they
    share is copied to one CPU block, ref-counted here, and comes back as one GPU block.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self.ref_counts = [0] * num_blocks
        self.tables: dict[Request, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def swap_out(
        self, pool: BlockPool, request: Request | Sequence[Request]
    ) -> list[tuple[int, int]] | None:
        """Move the requests' blocks to CPU, each distinct block once; returns (gpu, cpu)
        copies, or None (nothing changed) if the swap space is short."""
        requests = [request] if isinstance(request, Request) else list(request)
        gpu_to_cpu: dict[int, int] = {}
        for req in requests:
            for block in req.block_table:
                gpu_to_cpu.setdefault(block, -1)
        if len(gpu_to_cpu) > len(self._free):
            return None
        for block in gpu_to_cpu:
            gpu_to_cpu[block] = self._free.pop()
        for req in requests:
            cpu_blocks = [gpu_to_cpu[b] for b in req.block_table]
            for c in cpu_blocks:
                self.ref_counts[c] += 1
            self.tables[req] = cpu_blocks
            pool.free(req)
        return list(gpu_to_cpu.items())

    def num_blocks_to_swap_in(self, requests: Iterable[Request]) -> int:
        return len({c for req in requests for c in self.tables[req]})

    def can_swap_in(self, pool: BlockPool, request: Request | Sequence[Request]) -> bool:
        requests = [request] if isinstance(request, Request) else list(request)
        # One extra block of headroom per sequence for the token its next step appends.
        return self.num_blocks_to_swap_in(requests) + len(requests) <= pool.num_free_blocks

    def swap_in(
        self, pool: BlockPool, request: Request | Sequence[Request]
    ) -> list[tuple[int, int]]:
        """Bring the requests' blocks back, a shared CPU block as one shared GPU block;
        returns (cpu, gpu) copies."""
        requests = [request] if isinstance(request, Request) else list(request)
        cpu_to_gpu: dict[int, int] = {}
        for req in requests:
            table = []
            for c in self.tables.pop(req):
                gpu = cpu_to_gpu.get(c)
                if gpu is None:
                    gpu = cpu_to_gpu[c] = pool.take_free_block()
                else:
                    pool.add_ref(gpu)
                table.append(gpu)
                self._unref(c)
            req.block_table = table
            req.num_hashed_blocks = 0
        return list(cpu_to_gpu.items())

    def _unref(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free.append(block)

    def discard(self, request: Request) -> None:
        for c in reversed(self.tables.pop(request, [])):
            self._unref(c)

    def check_integrity(self) -> None:
        refs = [0] * self.num_blocks
        for table in self.tables.values():
            assert len(set(table)) == len(table), "a swapped request lists a CPU block twice"
            for c in table:
                refs[c] += 1
        assert refs == self.ref_counts, "CPU ref counts differ from the swapped tables"
        free = set(self._free)
        assert len(free) == len(self._free), "a CPU block is free twice"
        assert not {c for c, r in enumerate(refs) if r} & free, "a CPU block is free and held"
        assert len(free) + sum(1 for r in refs if r) == self.num_blocks, "CPU blocks leaked"
