"""Which KV blocks each sequence holds, and the prefix cache over them.

The tensors live in the runner (``runner/kv_pool.py``); this manager only hands
out block ids. Block 0 (``DUMMY_BLOCK``) is never handed out: it is the
padding target of captured decode batches.

Every handed-out block has a reference count: the number of sequences whose
block table holds it. With prefix caching on (``enable_prefix_caching``):

* A full block is named by a hash chained over its parent block's hash and its
  token ids; the chain starts from a root hash of the sequence's ``cache_salt``,
  so blocks of different salts never match. sha256 (``block_hash``), not Python's
  ``hash``: a collision would silently give one request another's KV, and token
  ids can be chosen by a client to collide under a weak hash. It costs about
  1 us per 16-token block on the host, once per full block.
* A block becomes findable by its hash only once its KV has been computed: the
  scheduler calls ``cache_full_blocks`` after the step (never at allocation), so a
  sequence preempted or aborted before its step ran leaves nothing findable.
* A new sequence takes its longest cached prefix of full blocks (``match`` /
  ``admit``) and computes only the rest; at least its last token is always
  computed, so a prompt whose every full block is cached still recomputes its
  last full block (the vLLM rule: a cached block is never written to).
* A freed block stays cached while no one holds it, in a least-recently-used
  pool; a new block is the oldest uncached free block first, else the least
  recently used cached one (whose hash is then forgotten). Every operation is
  O(1) per block: a deque and an OrderedDict.

With a sliding window on every layer (``window``, Mistral v0.1), a block wholly
before the window of a sequence's next query is read by no layer again: the
scheduler hands it back (``drop_outside_window``) and the sequence's table keeps
the dummy block in its place, which the attention kernels never read (they start
at the window) and the references read masked. A dropped block that was cached
stays findable (its KV is intact until it is handed out again, when its hash is
forgotten); one dropped before it was registered is never registered.

With a draft model (``draft_kv``; speculative decoding, ``engine/speculative.py``) every
block holds the draft's K/V of its tokens too, in the draft's pool, written only where the
draft ran on them: each sequence's frontier (``Sequence.draft_kv_len``) may trail its
computed tokens. A block is cached once the target's K/V of it is computed, whatever the
draft's; the manager marks the blocks a frontier has passed (``mark_draft_kv``: their draft
K/V is written, whoever wrote it), and a sequence admitted on cached blocks starts its
frontier after its leading marked ones, so its draft catches up the rest before it reads
them. (Such a catch-up writes a shared block's draft K/V again: the same tokens after the
same prefix, so the values another reader of it holds, up to rounding.) Blocks wholly
before a sliding window are kept until the draft's frontier has passed them too: its
catch-up attends to them.

With prefix caching off nothing is hashed and blocks go back to one free list,
in the order they were freed. ``reset_cache`` forgets every hash (only while no
block is held): a benchmark round, or a switch of the caching setting, then
starts from an empty cache.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections import OrderedDict, deque
from typing import Optional, Sequence as Seq

from ingot.engine.sequence import Sequence
from ingot.runner.kv_pool import DUMMY_BLOCK, blocks_for


@functools.lru_cache(maxsize=1024)
def root_hash(cache_salt: Optional[str]) -> bytes:
    """The parent hash of a sequence's first block: unsalted and each salt differ."""
    salt = b"\x00" if cache_salt is None else b"\x01" + cache_salt.encode()
    return hashlib.sha256(b"ingot-kv-block\x00" + salt).digest()


def block_hash(parent: bytes, token_ids: Seq[int]) -> bytes:
    """The hash of one full block: its parent's hash and its token ids (int32, little-endian)."""
    return hashlib.sha256(parent + _int32s(len(token_ids)).pack(*token_ids)).digest()


@functools.lru_cache(maxsize=None)
def _int32s(n: int) -> struct.Struct:
    return struct.Struct(f"<{n}i")  # 3.5x faster than array("i", ids).tobytes() for 16 ids


class BlockManager:
    """Reference-counted KV blocks (ids 1..num_blocks-1) and, optionally, the prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 window: Optional[int] = None, draft_kv: bool = False) -> None:
        """``window``: the sliding window every layer attends within (None: some layer sees
        the whole context, so no block is dropped before its sequence ends); ``draft_kv``: a
        draft model shares the blocks (above)."""
        assert num_blocks >= 2, "need at least one usable block besides the dummy"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = enable_prefix_caching
        self.window = window
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(DUMMY_BLOCK + 1, num_blocks))  # held by no one, not cached
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, held by no one: least recently used first
        self.hash_of: list[Optional[bytes]] = [None] * num_blocks  # the hash of each cached block
        self.cached: dict[bytes, int] = {}  # hash -> the block holding that KV
        self.draft_kv = draft_kv
        self.draft_written = bytearray(num_blocks)  # 1: the block's draft K/V is written (a full block)

    @property
    def num_free(self) -> int:
        """Blocks a sequence could be given now (cached ones are evicted on demand)."""
        return len(self.free_blocks) + len(self.evictable)

    @property
    def capacity_tokens(self) -> int:
        """Tokens one sequence could ever hold: every usable block."""
        return (self.num_blocks - 1) * self.block_size

    # ------------------------------------------------------------------ growing
    def extra_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks ``seq`` still needs so that ``num_tokens`` of its tokens fit."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(seq.block_ids))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.extra_blocks(seq, num_tokens) <= self.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        need = self.extra_blocks(seq, num_tokens)
        assert need <= self.num_free, "caller must check can_grow first"
        seq.block_ids.extend(self._allocate() for _ in range(need))

    def _allocate(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.popleft()
        else:  # evict the least recently used cached block
            block, _ = self.evictable.popitem(last=False)
            del self.cached[self.hash_of[block]]  # type: ignore[index]
            self.hash_of[block] = None
        self.ref_counts[block] = 1
        self.draft_written[block] = 0
        return block

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s hold on its blocks; cached ones stay findable until evicted."""
        ids = seq.block_ids
        # caching: the last blocks of a sequence go to the evictable pool first, so they are
        # evicted before its first ones (a prefix is worthless without its first blocks)
        for block in reversed(ids) if self.caching else ids:
            if block != DUMMY_BLOCK:  # (dropped outside the window)
                self._release(block)
        del ids[:]
        seq.num_cached_blocks = 0
        seq.num_dropped_blocks = 0
        seq.num_draft_blocks = seq.draft_kv_len = 0

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Hand back ``seq``'s blocks past those ``num_tokens`` tokens need: speculative
        decoding grew it for drafts that were rejected (never registered: not computed)."""
        ids = seq.block_ids
        keep = blocks_for(num_tokens, self.block_size)
        while len(ids) > keep:
            self._release(ids.pop())

    def _release(self, block: int) -> None:
        """One hold fewer on ``block``; held by no one, it is free (or evictable, if cached)."""
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if self.hash_of[block] is None:
                self.free_blocks.append(block)
            else:
                self.evictable[block] = None

    def drop_outside_window(self, seq: Sequence, first_query: int) -> None:
        """Hand back ``seq``'s blocks that no query from position ``first_query`` on can see
        (every layer windowed: wholly before ``first_query - window + 1``); their table entries
        become the dummy block. A step still reading them was queued before any step that
        could write them again (one stream), so this is safe at scheduling time. With a draft
        model, not before the draft's frontier (its catch-up queries start there)."""
        if self.window is None:
            return
        if self.draft_kv:
            first_query = min(first_query, seq.draft_kv_len)
        ids = seq.block_ids
        end = min(max(0, first_query - self.window + 1) // self.block_size, len(ids))
        for i in range(seq.num_dropped_blocks, end):
            self._release(ids[i])
            ids[i] = DUMMY_BLOCK
        seq.num_dropped_blocks = max(seq.num_dropped_blocks, end)

    # ------------------------------------------------------------------ prefix cache
    def reset_cache(self) -> bool:
        """Forget every cached block's hash, so no later sequence can hit KV computed before;
        the evictable blocks become plain free blocks. False (and nothing changes) while any
        block is held: its sequence would register blocks computed before the reset later."""
        if any(self.ref_counts):
            return False
        self.free_blocks.extend(self.evictable)  # least recently used first, as eviction would take them
        self.evictable.clear()
        self.cached.clear()
        self.hash_of[:] = [None] * self.num_blocks
        return True

    def match(self, seq: Sequence) -> list[int]:
        """The cached blocks of ``seq``'s longest cached prefix (none with caching off).

        At most ``(num_tokens - 1) // block_size`` blocks: the last token is always computed.
        Hashes are computed lazily, so a miss on the first block costs one hash. A request
        for prompt logprobs computes its whole prompt (cached tokens have no logits).
        """
        if not self.caching or seq.params.prompt_logprobs is not None:
            return []
        hits: list[int] = []
        for i in range((seq.num_tokens - 1) // self.block_size):
            block = self.cached.get(self._hash(seq, i))
            if block is None:
                break
            hits.append(block)
        return hits

    def can_admit(self, hits: list[int], num_tokens: int, reserved: int = 0) -> bool:
        """Would a sequence that reuses ``hits`` fit ``num_tokens`` tokens, leaving ``reserved``
        blocks free? Hits held by no one leave the evictable pool when taken, so they count
        against the free blocks."""
        need = blocks_for(num_tokens, self.block_size) - len(hits)
        refs = self.ref_counts
        taken = sum(1 for block in hits if refs[block] == 0)
        return need <= self.num_free - taken - reserved

    def admit(self, seq: Sequence, hits: list[int], num_tokens: int) -> None:
        """Give a waiting ``seq`` (no blocks yet) the cached ``hits``, then fresh blocks up to ``num_tokens``."""
        assert not seq.block_ids, "a waiting sequence holds no blocks"
        refs = self.ref_counts
        for block in hits:
            if refs[block] == 0:
                del self.evictable[block]
            refs[block] += 1
        seq.block_ids.extend(hits)
        seq.num_cached_blocks = len(hits)
        if self.draft_kv:
            written = self.draft_written
            seq.num_draft_blocks = next((i for i, block in enumerate(hits) if not written[block]), len(hits))
            seq.draft_kv_len = seq.num_draft_blocks * self.block_size
        self.grow(seq, num_tokens)

    def cache_full_blocks(self, seq: Sequence, computed: Optional[int] = None) -> None:
        """Make ``seq``'s blocks whose KV is computed (its first ``computed`` tokens, default
        all it has) and full findable by hash.

        Called after the step that computed them. A block whose hash is already
        cached (the same prefix computed twice in one step) stays uncached and is
        freed as a plain block.
        """
        full = (seq.num_computed_tokens if computed is None else computed) // self.block_size
        for i in range(seq.num_cached_blocks, full):
            block = seq.block_ids[i]
            if block == DUMMY_BLOCK:  # dropped outside the window before this step was read back
                continue
            h = self._hash(seq, i)
            if h not in self.cached:
                self.cached[h] = block
                self.hash_of[block] = h
        seq.num_cached_blocks = full

    def mark_draft_kv(self, seq: Sequence) -> None:
        """Mark ``seq``'s full blocks before its draft frontier (``draft_kv_len``) as holding
        the draft's K/V: a later sequence that hits them starts its draft's frontier after them."""
        full = seq.draft_kv_len // self.block_size
        for i in range(seq.num_draft_blocks, full):
            self.draft_written[seq.block_ids[i]] = 1  # (one dropped outside the window: the dummy, never hit)
        seq.num_draft_blocks = max(full, seq.num_draft_blocks)

    def _hash(self, seq: Sequence, i: int) -> bytes:
        """Hash of ``seq``'s full block ``i``, computed once per sequence (tokens never change)."""
        hashes = seq.block_hashes
        bs = self.block_size
        while len(hashes) <= i:
            j = len(hashes)
            parent = hashes[-1] if hashes else root_hash(seq.cache_salt)
            hashes.append(block_hash(parent, seq.tokens(j * bs, (j + 1) * bs)))
        return hashes[i]
