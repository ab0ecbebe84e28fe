"""The cache of gathered chunks: ``cache_blocks`` slots, furthest-next-use eviction, prefetch.

Access order: the cache records the sequence of chunk accesses of the first micro-batch (forward,
recomputation and backward, as the hooks request them) and uses it from then on; during that first
micro-batch it uses the order the plan implies (chunks are in first-use order: ascending in
forward, descending in backward). Both are the same on every rank, so every rank makes the same
eviction and prefetch decisions and issues the same collectives in the same order.

A slot is the right to hold one gathered chunk's payload; the payload storage is allocated into a
slot when a chunk is gathered and freed on eviction (see chunk.py for why each chunk keeps its own
storage). The cache never holds more than ``cache_blocks`` payloads; stale payloads (after an
optimizer step) keep their slot and are refilled in place.
"""

from __future__ import annotations

import bisect
import math

from elixir_tune.engine.chunks.chunk import Chunk
from elixir_tune.engine.comm import Handle


class CacheTooSmall(RuntimeError):
    """A module needs more chunks at once than the plan's cache blocks."""


class ChunkCache:
    """Holds at most ``cache_blocks`` gathered non-resident chunks.

    Args:
        chunks: all chunks (resident ones are ignored here).
        cache_blocks: slots.
        prefetch: chunks gathered ahead of use.
        placeholder: callable giving the NaN placeholder to unbind parameters with.
        side_stream: CUDA stream for prefetches (None: prefetch with async collectives only).
    """

    def __init__(self, chunks: list[Chunk], cache_blocks: int, prefetch: int, placeholder, side_stream=None):
        self.chunks = [chunk for chunk in chunks if not chunk.resident]
        self.by_id = {chunk.id: chunk for chunk in self.chunks}
        self.cache_blocks = cache_blocks
        self.prefetch = prefetch
        self._placeholder = placeholder
        self.side_stream = side_stream  # CUDA: prefetches run on it
        self.held: dict[int, Chunk] = {}  # chunks whose payload is allocated, by id
        self.inflight: dict[int, Handle] = {}
        self.unused_prefetch: set[int] = set()  # prefetched, not yet used
        ids = [chunk.id for chunk in self.chunks]
        self._set_trace(ids + ids[::-1])
        self._recording: list[int] | None = []
        self.pos = -1
        self.peak_bytes = 0
        self.gathers = 0  # chunks gathered (fetch + prefetch), for tests and benchmarks
        self.uploads = 0  # of those, host->device copies of offloaded shards

    # --- access order --------------------------------------------------------------------------

    def _set_trace(self, trace: list[int]) -> None:
        self.trace = trace
        self._positions: dict[int, list[int]] = {}
        for position, chunk_id in enumerate(trace):
            self._positions.setdefault(chunk_id, []).append(position)

    def start_microbatch(self) -> None:
        self.pos = -1
        if self._recording is not None:
            self._recording = []  # forwards without backward (evaluation) before the first step

    def finish_recording(self) -> None:
        """Ends the first micro-batch: its recorded accesses become the order used from now on."""
        if self._recording:
            self._set_trace(self._recording)
        self._recording = None

    def _advance(self, chunk_id: int) -> None:
        if self._recording is not None and (not self._recording or self._recording[-1] != chunk_id):
            self._recording.append(chunk_id)
        if 0 <= self.pos < len(self.trace) and self.trace[self.pos] == chunk_id:
            return
        positions = self._positions.get(chunk_id, [])
        i = bisect.bisect_right(positions, self.pos)
        if i < len(positions):
            self.pos = positions[i]

    def next_use(self, chunk_id: int, after: int | None = None) -> float:
        """Position of the chunk's next access after ``after`` (default: now; later micro-batches
        continue the trace)."""
        positions = self._positions.get(chunk_id)
        if not positions:
            return math.inf
        i = bisect.bisect_right(positions, self.pos if after is None else after)
        if i < len(positions):
            return positions[i]
        return len(self.trace) + positions[0]

    # --- slots ---------------------------------------------------------------------------------

    def _victim(self, keep: set[int], before: float | None = None) -> Chunk | None:
        """The evictable chunk used furthest in the future (only if later than ``before``).

        Chunks still awaiting gradients in this backward are taken only when no other chunk can go,
        and prefetched chunks not used yet only after them (evicting one wastes its gather).
        """
        for allow_awaiting, allow_prefetched in ((False, False), (True, False), (True, True)):
            best, best_use = None, -1.0
            for chunk_id, chunk in self.held.items():
                if chunk_id in keep or chunk_id in self.inflight or chunk.in_use():
                    continue
                if not allow_awaiting and chunk.awaiting_grads():
                    continue
                if not allow_prefetched and chunk_id in self.unused_prefetch:
                    continue
                use = self.next_use(chunk_id) if chunk.fresh else math.inf  # stale: free to take
                if use > best_use:
                    best, best_use = chunk, use
            if best is not None:
                if before is not None and (best_use <= before or allow_awaiting):
                    return None  # a prefetch never displaces what is needed sooner, nor a pending backward
                return best
        return None

    def evict(self, chunk: Chunk) -> None:
        self.unused_prefetch.discard(chunk.id)
        if chunk.fresh:
            chunk.unbind(self._placeholder(chunk))
        chunk.free()
        del self.held[chunk.id]

    def _make_room(self, keep: set[int], module_name: str, needed: int) -> None:
        while len(self.held) >= self.cache_blocks:
            victim = self._victim(keep)
            if victim is None:
                busy = sorted(c.id for c in self.held.values() if c.in_use() or c.id in keep)
                raise CacheTooSmall(
                    f"module {module_name!r} needs {needed} non-resident chunk(s) at once while chunks {busy} are "
                    f"in use, but the plan has memory.cache_blocks={self.cache_blocks}; use at least "
                    f"{len(busy) + 1} cache blocks (or bigger chunks) for this model"
                )
            self.evict(victim)

    def _start_gather(self, chunk: Chunk, async_op: bool) -> Handle:
        self.held[chunk.id] = chunk
        chunk.allocate()
        self.peak_bytes = max(self.peak_bytes, sum(c.payload_bytes() for c in self.held.values()))
        self.gathers += 1
        self.uploads += chunk.offload
        return chunk.gather(async_op=async_op, side_stream=self.side_stream if async_op else None)

    # --- the entry point -----------------------------------------------------------------------

    def fetch(self, chunks: list[Chunk], module_name: str) -> None:
        """Makes ``chunks`` (non-resident ones of one module) gathered and bound, then prefetches.

        Args:
            chunks: the chunks the module is about to use.
            module_name: for the error message when the cache is too small.
        """
        keep = {chunk.id for chunk in chunks}
        for chunk in chunks:
            self._advance(chunk.id)
            self.unused_prefetch.discard(chunk.id)
            handle = self.inflight.pop(chunk.id, None)
            if handle is not None:
                handle.wait()
                chunk.bind()
            elif not chunk.fresh:
                if chunk.id not in self.held:
                    self._make_room(keep, module_name, len(chunks))
                self._start_gather(chunk, async_op=False).wait()
                chunk.bind()
        if self.prefetch > 0:
            self._prefetch(keep)

    def _prefetch(self, keep: set[int]) -> None:
        seen = set(keep)
        position = self.pos + 1
        # Within this micro-batch only: chunks fetched for the next one would go stale at the step.
        while len(self.inflight) < self.prefetch and position < len(self.trace):
            chunk_id = self.trace[position]
            position += 1
            if chunk_id in seen:
                continue
            seen.add(chunk_id)
            if len(seen) - len(keep) > self.prefetch:
                return  # only look as far ahead as the prefetch depth
            chunk = self.by_id[chunk_id]
            if chunk.fresh or chunk_id in self.inflight:
                continue
            if chunk_id not in self.held and len(self.held) >= self.cache_blocks:
                victim = self._prefetch_victim(keep, self.next_use(chunk_id))
                if victim is None:
                    return
                self.evict(victim)
            self.inflight[chunk_id] = self._start_gather(chunk, async_op=True)
            self.unused_prefetch.add(chunk_id)

    def _prefetch_victim(self, keep: set[int], need_at: float) -> Chunk | None:
        """The chunk that fetching on demand at position ``need_at`` would evict (the held chunk
        used furthest after it), if it may go now: nothing needs it before then. Otherwise None
        (the prefetch waits), so that prefetching only issues the fetches of demand fetching
        earlier, as the cost model's timeline assumes, and never adds one."""
        best, best_use = None, -1.0
        for chunk in self.held.values():
            current = chunk.fresh or chunk.id in self.inflight  # being gathered: current once bound
            use = self.next_use(chunk.id, after=int(need_at)) if current else math.inf
            if use > best_use:
                best, best_use = chunk, use
        if best is None or best_use <= need_at or best.id in keep or best.id in self.inflight:
            return None
        if best.in_use() or best.awaiting_grads() or (best.fresh and self.next_use(best.id) < need_at):
            return None
        return best

    def wait_all(self) -> None:
        """Completes every prefetch in flight (leaves the chunks gathered)."""
        for chunk_id, handle in list(self.inflight.items()):
            handle.wait()
            self.by_id[chunk_id].bind()
        self.inflight.clear()

    def invalidate(self) -> None:
        """After an optimizer step: gathered copies are stale; slots stay allocated for reuse."""
        self.wait_all()
        self.unused_prefetch.clear()  # stale now: free to take
        for chunk in self.held.values():
            if chunk.fresh:
                chunk.unbind(self._placeholder(chunk))

    def release_all(self) -> None:
        """Frees every payload (outside training)."""
        self.wait_all()
        for chunk in list(self.held.values()):
            self.evict(chunk)
