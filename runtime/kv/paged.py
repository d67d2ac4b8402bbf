"""Paged KV bookkeeping: which physical KV rows each sequence owns, shares and may write.

The KV cache of a serving engine is one pool of `num_blocks` blocks of `block_size` rows (a row:
every layer's K and V for one token). A sequence sees its KV as a list of blocks, its BlockTable;
KV index i of a sequence lives in pool row `table[i // bs] * bs + i % bs` (its slot). Nothing here
touches KV data: this module decides slots, and says which block copies and row moves the back
end must do, so it is pure Python and can be checked exhaustively.

Sharing. A block may sit in several tables (prefix cache hits, forks); the pool counts references.
Two rules keep every shared row right:
  * a block is written in place only by its one holder (refcount 1); a writer of a shared block
    gets a fresh block first and the back end copies the old one into it (copy-on-write, the
    (src, dst) pairs append_slots and compact return), and
  * a block that carries a prefix-cache hash holds exactly the tokens the hash names, so a holder
    that rewrites it (after a truncate or a compaction) first takes its hash off the cache.

Prefix cache (vLLM's automatic prefix caching). A FULL block is named by
blake2b-128(parent block's hash || its token ids as int64): a hash of the whole prefix up to and
including the block, so equal hashes mean equal token histories, hence equal KV. blake2b rather
than Python's hash(): tuple hashes of ints are 64-bit, the same in every process and easy to
collide on purpose, and a collision here would hand one client another's KV (vLLM moved to
sha256 for this); 128 bits make an accidental collision negligible (birthday bound ~2^64 blocks)
and blake2b is the fastest hashlib digest. Blocks become hashed when their tokens are committed
(after the step that wrote them), prompt and generated tokens alike, so a sequence preempted for
recompute finds its own blocks again. Blocks whose refcount drops to 0 keep their hash on an LRU
"evictable" list and can be revived by a hit until an allocation needs them: allocation takes a
never-hashed free block first, then the least recently freed cached one (its hash is dropped).
A sequence's blocks are freed tail first, so a chain's tail is evicted before its head (a head is
worth more: every longer prefix runs through it, and a tail is unreachable without it).

The last prompt token is always computed, so the first sampled token has logits. When a whole
prompt (a multiple of bs tokens) is in the cache, every block is shared and the last token, whose
row lies in the last shared block, is recomputed: writing it follows the rules above. If another
sequence still holds that block it is copied (one block copy instead of vLLM's recompute of the
whole last block, bs - 1 more tokens); if the hit revived it from the evictable list we are its
only holder, so its hash is dropped and the row is rewritten in place. Either way the commit after
the step finds the block full again with the same hash: if another block already carries it the
sequence switches to that block and frees its own (so a copy lives for one step only, and two
sequences that computed the same prefix side by side end up sharing one set of blocks); else the
block is registered again. A back end whose store kernel can skip a row (a slot of -1) could avoid
even that copy; the rows it would write are already there.

Rollback and eviction. truncate(seq, n) drops KV entries from n on exactly (speculative decoding's
rejected tokens): tail blocks go back to the pool, the kept part is untouched. compact(seq, keep)
moves the surviving entries of an eviction (sliding window, SnapKV, H2O) down to KV indices
0..k-1 inside the sequence's own blocks and frees the rest: it returns the block copies for the
blocks it must write that others share, and the source and destination slot of every kept entry.
After a compaction KV index i no longer holds token i, so the sequence stops hashing blocks
(the untouched blocks before the first moved entry stay shared and cached).

Internal errors (a block freed twice, a block used with refcount 0, slots past a table) are
BlockError: a bug in the caller or here, never bad user input. Sizing errors are ValueErrors.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

HASH_BYTES = 16
_I32_MAX = np.iinfo(np.int32).max

# bytes per group of values of each KV dtype: q8_0 is 32 int8 + an f16 scale, q4_0 32 nibbles + a scale
KV_DTYPES = {"f32": (4, 1), "f16": (2, 1), "q8_0": (34, 32), "q4_0": (18, 32)}


class BlockError(RuntimeError):
    """A bookkeeping invariant broken: a bug in the caller or in this module, not bad input."""


def block_hash(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """The prefix-cache name of a full block: blake2b-128 of its parent's name and its tokens."""
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    if parent is not None:
        h.update(parent)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


def kv_block_bytes(n_layers: int, block_size: int, n_kv_heads: int, head_dim: int, kv_dtype: str) -> int:
    """Bytes of one block in every layer: n_layers * 2 (K, V) * block_size * n_kv_heads * a head row."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype {kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
    group_bytes, group = KV_DTYPES[kv_dtype]
    if head_dim % group:
        raise ValueError(f"kv_dtype {kv_dtype} stores head rows in blocks of {group} values, but head_dim is "
                         f"{head_dim}; use f16 or f32")
    for name, v in (("n_layers", n_layers), ("block_size", block_size), ("n_kv_heads", n_kv_heads),
                    ("head_dim", head_dim)):
        if v < 1:
            raise ValueError(f"{name} must be at least 1, got {v}")
    return n_layers * 2 * block_size * n_kv_heads * (head_dim // group) * group_bytes


def num_blocks_for_budget(budget_bytes: int, n_layers: int, block_size: int, n_kv_heads: int, head_dim: int,
                          kv_dtype: str) -> int:
    """How many blocks a KV budget of budget_bytes holds (at least 1, or a one-line ValueError)."""
    per_block = kv_block_bytes(n_layers, block_size, n_kv_heads, head_dim, kv_dtype)
    n = budget_bytes // per_block
    if n < 1:
        raise ValueError(f"a KV budget of {budget_bytes} bytes holds no block of {per_block} bytes "
                         f"({kv_dtype}, block_size {block_size}); raise the budget or lower --block-size")
    return int(n)


class BlockPool:
    """Physical blocks 0..num_blocks-1: reference counts, a free stack and the prefix cache's index.

    A block is in exactly one of three states: free (refcount 0, no hash, on the free stack),
    evictable (refcount 0, hashed, on the LRU list, revivable by a hit) or used (refcount > 0).
    The free list is a stack so a block freed a moment ago (its lines maybe still in a cache) is
    reused first; allocate, incref, decref and lookup are O(1).
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV pool needs num_blocks >= 1 and block_size >= 1, got {num_blocks} and "
                             f"{block_size}; set --num-blocks and --block-size")
        if num_blocks * block_size > _I32_MAX:
            raise ValueError(f"{num_blocks} blocks of {block_size} rows overflow the kernels' int32 slots; "
                             "lower --num-blocks")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.refcount = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))      # stack: block 0 is handed out first
        self._evictable: OrderedDict[int, None] = OrderedDict()   # LRU first
        self._by_hash: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks never hashed or whose hash was dropped: allocation takes these first."""
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        """Blocks no sequence holds that still serve the prefix cache."""
        return len(self._evictable)

    @property
    def num_available(self) -> int:
        """Blocks an allocation can get now."""
        return len(self._free) + len(self._evictable)

    def allocate(self) -> int:
        """A block with refcount 1: a free one, else the least recently used cached one (unhashed)."""
        if self._free:
            b = self._free.pop()
        elif self._evictable:
            b, _ = self._evictable.popitem(last=False)
            del self._by_hash[self.hash_of[b]]
            self.hash_of[b] = None
        else:
            raise BlockError("allocate from an exhausted block pool; check num_available first")
        self.refcount[b] = 1
        return b

    def incref(self, b: int) -> None:
        """One more holder; a cached block with no holder is taken off the evictable list."""
        if self.refcount[b] == 0:
            if b not in self._evictable:
                raise BlockError(f"block {b} is free; it cannot be shared")
            del self._evictable[b]
        self.refcount[b] += 1

    def decref(self, b: int) -> None:
        """One holder fewer; at 0 a hashed block turns evictable (most recent), others free."""
        if self.refcount[b] <= 0:
            raise BlockError(f"block {b} freed twice")
        self.refcount[b] -= 1
        if self.refcount[b] == 0:
            if self.hash_of[b] is not None:
                self._evictable[b] = None
            else:
                self._free.append(b)

    def lookup(self, h: bytes) -> int | None:
        """The block that holds the prefix named h, if the cache still has it."""
        return self._by_hash.get(h)

    def register(self, b: int, h: bytes) -> None:
        """Name a used, full block by its prefix hash (no other block may carry h)."""
        if self.refcount[b] == 0 or self.hash_of[b] is not None or h in self._by_hash:
            raise BlockError(f"block {b} cannot be registered: refcount {self.refcount[b]}, "
                             f"hashed {self.hash_of[b] is not None}, hash taken {h in self._by_hash}")
        self.hash_of[b] = h
        self._by_hash[h] = b

    def unregister(self, b: int) -> None:
        """Take a used block off the cache: its holder is about to change its rows."""
        h = self.hash_of[b]
        if h is None or self.refcount[b] == 0:
            raise BlockError(f"block {b} is not a used cached block")
        del self._by_hash[h]
        self.hash_of[b] = None

    def check(self) -> None:
        """Raise BlockError unless every block is in exactly one state and the hash index agrees."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise BlockError("a block is on the free list twice")
        evictable = set(self._evictable)
        for b in range(self.num_blocks):
            rc, h = self.refcount[b], self.hash_of[b]
            state = (b in free) + (b in evictable) + (rc > 0)
            if rc < 0 or state != 1:
                raise BlockError(f"block {b}: refcount {rc}, free {b in free}, evictable {b in evictable}")
            if (b in free and h is not None) or (b in evictable and h is None):
                raise BlockError(f"block {b}: hashed {h is not None} but free {b in free}")
            if h is not None and self._by_hash.get(h) != b:
                raise BlockError(f"block {b}: its hash names block {self._by_hash.get(h)}")
        if len(self._by_hash) != sum(h is not None for h in self.hash_of):
            raise BlockError("the hash index names blocks that carry no hash")


class BlockTable:
    """A sequence's logical -> physical block list. KV index i lives in slot blocks[i // bs] * bs + i % bs."""

    def __init__(self, block_size: int, blocks: list[int] | None = None):
        self.block_size = block_size
        self.blocks: list[int] = list(blocks or [])

    def __len__(self) -> int:
        return len(self.blocks)

    def slot(self, pos: int) -> int:
        """The pool row of KV index pos."""
        if not 0 <= pos < len(self.blocks) * self.block_size:
            raise BlockError(f"KV index {pos} is outside a table of {len(self.blocks)} blocks")
        return self.blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    def slots_of(self, positions: np.ndarray) -> np.ndarray:
        """int32 pool rows of any array of KV indices (same shape)."""
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and (pos.min() < 0 or pos.max() >= len(self.blocks) * self.block_size):
            raise BlockError(f"KV indices {pos.min()}..{pos.max()} reach outside a table of "
                             f"{len(self.blocks)} blocks")
        table = np.asarray(self.blocks, dtype=np.int64)
        if not pos.size:
            return pos.astype(np.int32)
        return (table[pos // self.block_size] * self.block_size + pos % self.block_size).astype(np.int32)

    def slots(self, start: int, n: int) -> np.ndarray:
        """int32 [n]: the pool rows of KV indices start..start+n-1, as the kernels' kv_store takes them."""
        bs, blocks = self.block_size, self.blocks
        if 0 < n <= bs and 0 <= start and start + n <= len(blocks) * bs:
            # a decode's row or a short chunk, every step for every sequence: Python's ints cost a
            # fraction of slots_of's array setup (its table copy above all)
            return np.array([blocks[p // bs] * bs + p % bs for p in range(start, start + n)], np.int32)
        return self.slots_of(np.arange(start, start + n))

    def as_array(self, max_blocks: int, pad: int = 0) -> np.ndarray:
        """int32 [max_blocks]: the kernels' block-table row. Padding names block 0 by default, a real
        block, so a kernel that loads a whole tile before masking by ctx_len stays inside the pool."""
        if len(self.blocks) > max_blocks:
            raise BlockError(f"a table of {len(self.blocks)} blocks does not fit a row of {max_blocks}")
        row = np.full(max_blocks, pad, dtype=np.int32)
        row[:len(self.blocks)] = self.blocks
        return row


@dataclass
class _SeqKV:
    table: BlockTable
    num_slots: int = 0          # KV entries with a slot: committed + written by a step in flight
    num_committed: int = 0      # KV entries whose step has finished
    tokens: list[int] = field(default_factory=list)   # token of each committed entry, while hashable
    hashes: list[bytes] = field(default_factory=list)   # names of table.blocks[:len(hashes)], all full
    hashable: bool = True       # False once a compaction made KV index != token index


@dataclass(frozen=True)
class Compaction:
    """What the back end does for compact(): first the block copies (src_block, dst_block), in
    order; then each kept entry's row from src_slots to dst_slots. src_slots has keep's shape
    ([k], or [..., k] per layer / KV head); dst_slots is [k]. Gather every source before writing
    (or move in ascending order along k): a destination may be another entry's source. Do both
    before the sequence's next step, and before any other allocation's step writes: the freed
    tail blocks (sources among them) go back to the pool at once."""
    copies: list[tuple[int, int]]
    src_slots: np.ndarray
    dst_slots: np.ndarray
    freed_blocks: int

    @property
    def moves(self) -> list[tuple[int, int]]:
        """(src_slot, dst_slot) of each entry that moves, for a keep list shared by every head."""
        if self.src_slots.ndim != 1:
            raise BlockError("moves is for a 1-D keep list; use src_slots / dst_slots per head")
        return [(int(s), int(d)) for s, d in zip(self.src_slots, self.dst_slots) if s != d]


@dataclass(frozen=True)
class KVStats:
    num_blocks: int
    free: int           # never hashed (or dropped) and unheld
    cached: int         # unheld but still in the prefix cache
    used: int           # held by at least one sequence
    query_tokens: int   # prompt tokens looked up in the prefix cache
    hit_tokens: int     # of those, found cached (not recomputed)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class BlockManager:
    """The pool, the prefix cache and every sequence's table.

    The life of a sequence: allocate(seq, prompt) shares its cached prefix and says how many
    tokens need no compute; before each step append_slots(seq, n) gives the slots of the n
    entries the step writes (and the block copies to do before it); after the step
    commit(seq, tokens) records what was written and hashes the blocks it filled; free(seq) at the
    end. fork, truncate and compact change a live sequence's blocks. A sequence is any hashable id.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True):
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self._seqs: dict[Hashable, _SeqKV] = {}
        self._query_tokens = 0
        self._hit_tokens = 0

    # ---- sizing -------------------------------------------------------------------------------
    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def can_allocate(self, n_tokens: int) -> bool:
        """Whether a new sequence of n_tokens fits now, counting no prefix hit (a hit needs fewer)."""
        return self.blocks_for(n_tokens) <= self.pool.num_available

    def blocks_needed(self, seq_id: Hashable, n: int) -> int:
        """Blocks append_slots(seq_id, n) would take: new ones and copies of shared ones it writes."""
        kv = self._seqs[seq_id]
        if n <= 0:
            return 0
        end_block = self.blocks_for(kv.num_slots + n)
        first = kv.num_slots // self.block_size
        cow = sum(self.pool.refcount[kv.table.blocks[i]] > 1 for i in range(first, min(end_block, len(kv.table))))
        return max(0, end_block - len(kv.table)) + cow

    def max_append(self, seq_id: Hashable, limit: int) -> int:
        """The most tokens (<= limit) append_slots could place with the blocks available now."""
        avail = self.pool.num_available
        lo, hi = 0, limit
        while lo < hi:                        # blocks_needed only grows with n
            mid = (lo + hi + 1) // 2
            if self.blocks_needed(seq_id, mid) <= avail:
                lo = mid
            else:
                hi = mid - 1
        return lo

    # ---- a sequence's life --------------------------------------------------------------------
    def cached_prefix(self, token_ids: Sequence[int]) -> int:
        """Tokens of token_ids allocate() would take from the cache now (no side effect)."""
        return self._capped(len(self._lookup(token_ids)) * self.block_size, len(token_ids))

    def allocate(self, seq_id: Hashable, token_ids: Sequence[int]) -> int:
        """Start seq_id: share the longest cached chain of its full blocks; return how many of its
        tokens need no compute (never all of them: the last one is computed for its logits)."""
        if seq_id in self._seqs:
            raise BlockError(f"sequence {seq_id!r} already has KV blocks")
        chain = self._lookup(token_ids)
        for _, b in chain:
            self.pool.incref(b)
        kv = _SeqKV(BlockTable(self.block_size, [b for _, b in chain]), hashes=[h for h, _ in chain])
        cached = self._capped(len(chain) * self.block_size, len(token_ids))
        kv.num_slots = kv.num_committed = cached
        kv.tokens = list(token_ids[:cached])
        self._seqs[seq_id] = kv
        if self.enable_prefix_cache:
            self._query_tokens += len(token_ids)
            self._hit_tokens += cached
        return cached

    def append_slots(self, seq_id: Hashable, n: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """int32 [n] slots of the next n KV entries of seq_id, and the (src, dst) block copies the
        back end makes before the step writes them (copy-on-write of shared blocks)."""
        kv = self._seqs[seq_id]
        if self.blocks_needed(seq_id, n) > self.pool.num_available:
            raise BlockError(f"sequence {seq_id!r}: {n} slots need {self.blocks_needed(seq_id, n)} blocks, "
                             f"{self.pool.num_available} available; check max_append first")
        start, copies = kv.num_slots, []
        first = start // self.block_size
        for i in range(first, min(self.blocks_for(start + n), len(kv.table)) if n else first):
            copies += self._make_writable(kv, i)
        while len(kv.table) < self.blocks_for(start + n):
            kv.table.blocks.append(self.pool.allocate())
        kv.num_slots += n
        return kv.table.slots(start, n), copies

    def commit(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        """The step that wrote the next len(token_ids) entries of seq_id has run: hash the blocks it
        filled into the prefix cache (a block whose prefix another block already holds is dropped
        for that one, so equal prefixes share one set of blocks)."""
        kv = self._seqs[seq_id]
        if kv.num_committed + len(token_ids) > kv.num_slots:
            raise BlockError(f"sequence {seq_id!r}: commit of {len(token_ids)} tokens past its "
                             f"{kv.num_slots - kv.num_committed} slots in flight")
        kv.num_committed += len(token_ids)
        if not (self.enable_prefix_cache and kv.hashable):
            return
        kv.tokens.extend(token_ids)
        bs = self.block_size
        for i in range(len(kv.hashes), len(kv.tokens) // bs):
            h = block_hash(kv.hashes[-1] if kv.hashes else None, kv.tokens[i * bs:(i + 1) * bs])
            b, cached = kv.table.blocks[i], self.pool.lookup(h)
            if cached is None:
                self.pool.register(b, h)
            elif cached != b:
                self.pool.incref(cached)
                kv.table.blocks[i] = cached
                self.pool.decref(b)
            kv.hashes.append(h)

    def free(self, seq_id: Hashable) -> None:
        """Release every block of seq_id, tail first (the LRU then evicts a chain's tail first)."""
        kv = self._seqs.pop(seq_id)
        for b in reversed(kv.table.blocks):
            self.pool.decref(b)

    def fork(self, parent: Hashable, child: Hashable) -> None:
        """child starts as parent: every block shared (copied on the first write by either)."""
        if child in self._seqs:
            raise BlockError(f"sequence {child!r} already has KV blocks")
        kv = self._seqs[parent]
        for b in kv.table.blocks:
            self.pool.incref(b)
        self._seqs[child] = _SeqKV(BlockTable(self.block_size, kv.table.blocks), kv.num_slots, kv.num_committed,
                                   list(kv.tokens), list(kv.hashes), kv.hashable)

    def truncate(self, seq_id: Hashable, n_tokens: int) -> None:
        """Keep the first n_tokens KV entries of seq_id exactly; blocks past them go back to the pool."""
        kv = self._seqs[seq_id]
        if not 0 <= n_tokens <= kv.num_slots:
            raise BlockError(f"sequence {seq_id!r}: truncate to {n_tokens} of {kv.num_slots} entries")
        keep_blocks = self.blocks_for(n_tokens)
        for b in reversed(kv.table.blocks[keep_blocks:]):
            self.pool.decref(b)
        del kv.table.blocks[keep_blocks:]
        del kv.hashes[n_tokens // self.block_size:]
        del kv.tokens[n_tokens:]
        kv.num_slots = n_tokens
        kv.num_committed = min(kv.num_committed, n_tokens)

    def compact(self, seq_id: Hashable, keep_positions: np.ndarray) -> Compaction:
        """Move the kept KV entries of seq_id to indices 0..k-1 in its own blocks and free its tail.

        keep_positions: int [k] ascending KV indices, or [..., k] one ascending list per layer / KV
        head (SnapKV and H2O keep different entries per head, the same number in each). Only
        committed entries can be kept (no step may be in flight). Blocks that will be written and
        are shared are copied first; blocks before the first moved entry stay shared and cached.
        """
        kv = self._seqs[seq_id]
        keep = np.asarray(keep_positions)
        k = keep.shape[-1] if keep.ndim else -1
        if (keep.ndim == 0 or not np.issubdtype(keep.dtype, np.integer) or kv.num_slots != kv.num_committed
                or (keep.size and (keep.min() < 0 or keep.max() >= kv.num_committed))
                or (k > 1 and (np.diff(keep, axis=-1) <= 0).any())):
            raise BlockError(f"sequence {seq_id!r}: keep_positions must be ascending committed KV indices "
                             f"(< {kv.num_committed}, none in flight)")
        changed = (keep.reshape(-1, k) != np.arange(k)).any(axis=0) if keep.size else np.zeros(0, bool)
        first_moved = int(np.argmax(changed)) if changed.any() else k
        # blocks past every kept entry go first, so the copies below can reuse them under pressure;
        # the rest of the tail holds sources and goes only after the moves are planned
        freed = len(kv.table) - self.blocks_for(k)
        self.truncate(seq_id, int(keep.max()) + 1 if keep.size else 0)
        copies = []
        for i in range(first_moved // self.block_size, self.blocks_for(k)):
            copies += self._make_writable(kv, i)
        src = kv.table.slots_of(keep)
        dst = kv.table.slots(0, k)
        if first_moved < k:
            kv.hashable = False
            kv.tokens = []
        self.truncate(seq_id, k)
        return Compaction(copies, src, dst, freed)

    # ---- views ----------------------------------------------------------------------------------
    def table(self, seq_id: Hashable) -> BlockTable:
        return self._seqs[seq_id].table

    def num_slots(self, seq_id: Hashable) -> int:
        """KV entries seq_id holds (the KV index of its next entry)."""
        return self._seqs[seq_id].num_slots

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def stats(self) -> KVStats:
        p = self.pool
        return KVStats(p.num_blocks, p.num_free, p.num_evictable, p.num_blocks - p.num_available,
                       self._query_tokens, self._hit_tokens)

    def check(self) -> None:
        """Raise BlockError unless the pool is consistent and every refcount equals its holders
        (O(num_blocks): for tests and debugging, not every step)."""
        self.pool.check()
        holders = [0] * self.pool.num_blocks
        for seq_id, kv in self._seqs.items():
            if len(kv.table) != self.blocks_for(kv.num_slots) and not (
                    len(kv.table) == self.blocks_for(kv.num_slots + 1) and len(kv.hashes) * self.block_size
                    > kv.num_slots):
                raise BlockError(f"sequence {seq_id!r}: {len(kv.table)} blocks for {kv.num_slots} entries")
            for b in kv.table.blocks:
                holders[b] += 1
            for b, h in zip(kv.table.blocks, kv.hashes):
                if self.pool.hash_of[b] != h:
                    raise BlockError(f"sequence {seq_id!r}: block {b} lost the hash of its prefix")
        if holders != self.pool.refcount:
            bad = next(b for b in range(self.pool.num_blocks) if holders[b] != self.pool.refcount[b])
            raise BlockError(f"block {bad}: refcount {self.pool.refcount[bad]}, held by {holders[bad]} tables")

    # ---- internals ------------------------------------------------------------------------------
    def _capped(self, hit_tokens: int, n_tokens: int) -> int:
        return min(hit_tokens, max(n_tokens - 1, 0))

    def _lookup(self, token_ids: Sequence[int]) -> list[tuple[bytes, int]]:
        """(hash, block) of the longest cached chain of token_ids' full blocks."""
        if not self.enable_prefix_cache:
            return []
        chain, parent, bs = [], None, self.block_size
        for i in range(len(token_ids) // bs):
            h = block_hash(parent, token_ids[i * bs:(i + 1) * bs])
            b = self.pool.lookup(h)
            if b is None:
                break
            chain.append((h, b))
            parent = h
        return chain

    def _make_writable(self, kv: _SeqKV, i: int) -> list[tuple[int, int]]:
        """Let kv write block i: copy it if shared, take it off the cache if hashed."""
        b = kv.table.blocks[i]
        del kv.hashes[i:]
        if self.pool.refcount[b] > 1:
            nb = self.pool.allocate()
            self.pool.decref(b)
            kv.table.blocks[i] = nb
            return [(b, nb)]
        if self.pool.hash_of[b] is not None:
            self.pool.unregister(b)
        return []
