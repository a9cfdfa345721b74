"""The checkpoint pool (DESIGN.md §7): model state at stable boundaries, on the device, under a byte budget.

A checkpoint at position m holds, per Gated DeltaNet layer, the float32 recurrent state and the short-conv
window (the K-1 conv inputs before m) in one *slot*, and refers to the full-attention keys/values of
positions [0, m) in fixed-size *pages* (PAGE tokens, every attention layer). Pages are shared: a checkpoint
that extends another (the same lineage, resumed and grown) references the same pages and appends into its
last, partial page when nobody else has written past its end; a fork that diverges from a partial page
copies that one page (copy-on-write), never the full pages before it. Pages are freed when no checkpoint
refers to them; checkpoints are evicted least-recently-used when a slot or page is needed. A session's
checkpoint is dropped as soon as the same session saves one further on (it is *superseded*: the session
only ever resumes from its newest one, and its pages live on in the new one), unless a fork shares the
history up to it; so a session holds one slot plus the pages of its history, however many steps it takes.

Device memory is arenas of a fixed address (`arena.py`: the states, the windows, and per attention layer
its keys and its values), so kernels and captured graphs never see them move, sized for the pool's cap
(`budget_bytes`) but holding memory only for the slots and pages in use: the pool takes more when a save
finds none free (doubling, up to the cap; past it, least recently used checkpoints are evicted) and gives
back what it no longer uses when the device is idle (`trim`). Slots and pages are taken lowest first, so
the ones in use stay at the start. The host keeps the bookkeeping (free lists, reference counts, fill marks,
the hash index) and hands the round planner plain integer tables. Past the checkpoint slots, the state
arena has an always-zero row and `scratch_rows` rows where a round keeps its trunks' states
(`layout.StateRows`), so a round reads and saves states in place; the window arena has one sink slot and
the key/value arenas one sink page, where padded saves of a fixed-shape round go.
"""

from __future__ import annotations

import heapq
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from flide_sdk.device.arena import Arena, DeviceMemoryFull, PlainArena, arena
from flide_sdk.models.qwen35 import LayerCache
from flide_sdk.models.state import RecurrentShape, StateLayout
from flide_sdk.plan.layout import PAGE, StateRows
from flide_sdk.text.history import BLOCK, TokenBuffer, Trunk

PAGE_SLOTS = np.arange(PAGE, dtype=np.int64)  # offsets of a page's entries from its first
GROW_PAGES, GROW_SLOTS = 64, 4  # the least a growing pool adds (it doubles past these)
DEVICE_HEADROOM = 1 << 30  # device memory a growing pool leaves to the rounds' own allocations

LOG = logging.getLogger(__name__)


@dataclass(eq=False)
class Checkpoint:
    """Model state after tokens [0, length) of `buffer`."""

    buffer: TokenBuffer
    length: int
    slot: int
    pages: list[int]
    key: int  # chained hash of the first length // BLOCK blocks
    pins: int = 0


@dataclass(eq=False)
class PlannedSave:
    """A checkpoint to be written by a round: the pool slot, and the flat KV slots of positions [start, at)."""

    checkpoint: Checkpoint
    start: int
    kv_slots: np.ndarray
    page_copies: list[tuple[int, int]] = field(default_factory=list)
    base: Checkpoint | None = None  # the checkpoint it extends


@dataclass(frozen=True)
class PageUsage:
    """Per KV page: how many checkpoints reference it and how many entries are written from its start."""

    refs: np.ndarray
    fill: np.ndarray
    free: list[int]


class ModelConfig(Protocol):
    """What the pool reads of a model's config: what its checkpoints hold per layer."""

    def state_layout(self) -> StateLayout: ...


def token_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Key/value bytes of one token in the pool (every attention layer that keeps its own)."""
    return config.state_layout().token_bytes(dtype)


class CheckpointPool:
    """Device arenas for checkpoints plus their host bookkeeping; not thread-safe (the round thread owns it)."""

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        budget_bytes: int,
        max_checkpoints: int | None = None,
        scratch_rows: int = 64,
    ) -> None:
        self.device = device
        layout = self.layout = config.state_layout()
        self.gdn_layers = list(layout.recurrent_layers)
        self.slot_bytes = layout.slot_bytes(dtype)
        self.page_bytes = PAGE * layout.token_bytes(dtype)
        if self.slot_bytes:
            wanted = max_checkpoints if max_checkpoints is not None else max(4, int(0.25 * budget_bytes) // self.slot_bytes)
            slots = min(wanted, budget_bytes // self.slot_bytes)  # a zero budget disables checkpoints
        else:  # no recurrent state (attention only): a checkpoint is its pages, one at least
            slots = budget_bytes // self.page_bytes
            slots = slots if max_checkpoints is None else min(slots, max_checkpoints)
        pages = (budget_bytes - slots * self.slot_bytes) // self.page_bytes
        self.num_slots, self.num_pages = slots, pages  # at most, within the cap
        self.state_rows = StateRows(zero=slots, scratch=slots + 1, scratch_count=scratch_rows)
        self.window_sink = slots
        self.kv_sink = pages * PAGE
        # without recurrent layers the state and window arenas have rows of no elements (slots stay bookkeeping)
        shape = layout.recurrent or RecurrentShape(1, 1, 1, 1, 1)
        self._states = arena(self.state_rows.num_rows, (len(self.gdn_layers), shape.heads, shape.key_dim,
                                                        shape.value_dim), torch.float32, device, slots)
        self._windows = arena(slots + 1, (len(self.gdn_layers), shape.conv_kernel - 1, shape.conv_dim), dtype, device,
                              slots)
        self._kv = [arena((pages + 1) * PAGE, (kv.heads, kv.head_dim), dtype, device, pages * PAGE)
                    for kv in layout.key_values for _ in range(2)]  # per attention layer keeping its own: keys, values
        self._free_slots: list[int] = []  # heaps of the free slots and pages among the backed ones
        self._free_pages: list[int] = []
        self._page_refs = np.zeros(pages, dtype=np.int64)
        self._page_fill = np.zeros(pages, dtype=np.int64)  # entries written from the page start
        self._lru: OrderedDict[Checkpoint, None] = OrderedDict()
        self._index: dict[int, list[Checkpoint]] = {}
        self.counters = {"checkpoints_saved": 0, "evictions": 0, "superseded": 0, "page_copies": 0,
                         "growth_refused": 0}
        self._device_full = False  # the device refused to back more rows: grow no more until memory is given back

    # -------------------------------------------------------------------------------------- queries
    @property
    def capacity_bytes(self) -> int:
        """The cap: what the pool's slots and pages take when all are in use."""
        return self.num_slots * self.slot_bytes + self.num_pages * self.page_bytes

    @property
    def reserved_bytes(self) -> int:
        """Device memory the arenas hold now (the backed slots and pages, the scratch rows and sinks)."""
        return sum(a.reserved_bytes for a in self._arenas())

    @property
    def allocator_bytes(self) -> int:
        """The part of `reserved_bytes` that torch's caching allocator holds (arenas without virtual memory)."""
        return sum(a.reserved_bytes for a in self._arenas() if isinstance(a, PlainArena))

    @property
    def backed(self) -> tuple[int, int]:
        """Slots and pages that hold memory now."""
        return self._states.backed, self._kv[0].backed // PAGE if self._kv else 0

    @property
    def used_bytes(self) -> int:
        pages_used = self.backed[1] - len(self._free_pages)
        return len(self._lru) * self.slot_bytes + pages_used * self.page_bytes

    @property
    def num_checkpoints(self) -> int:
        return len(self._lru)

    def checkpoints(self) -> list[Checkpoint]:
        """The checkpoints held, least recently used first."""
        return list(self._lru)

    def page_usage(self) -> PageUsage:
        """A copy of the page bookkeeping: references and entries written per page, and the free pages."""
        free = sorted(self._free_pages) + list(range(self.backed[1], self.num_pages))  # unbacked pages are free too
        return PageUsage(self._page_refs.copy(), self._page_fill.copy(), free)

    def layer_caches(self) -> list[LayerCache]:
        """Per model layer, its views of the arenas (what the model's forward takes as `caches`): a layer that reads
        another's keys and values gets that layer's."""
        caches: dict[int, LayerCache] = {}
        for index, layer in enumerate(self.gdn_layers):
            caches[layer] = (self._states.tensor[:, index], self._windows.tensor[:, index])
        for index, kv in enumerate(self.layout.key_values):
            caches[kv.layer] = (self._kv[2 * index].tensor, self._kv[2 * index + 1].tensor)
        return [caches[source] for source in self.layout.sources]

    def lookup(self, trunk: Trunk) -> Checkpoint | None:
        """The furthest checkpoint whose tokens match the start of `trunk` (strictly shorter than it)."""
        for blocks in range((len(trunk) - 1) // BLOCK, -1, -1):
            candidates = self._index.get(trunk.block_hash(blocks))
            if not candidates:
                continue
            best = None
            for checkpoint in candidates:
                longer = best is None or checkpoint.length > best.length
                if checkpoint.length < len(trunk) and longer and trunk.prefix_equals(checkpoint.buffer, checkpoint.length):
                    best = checkpoint
            if best is not None:
                self._lru.move_to_end(best)
                return best
        return None

    # ------------------------------------------------------------------------------------- planning
    def pin(self, checkpoint: Checkpoint) -> None:
        checkpoint.pins += 1

    def unpin(self, checkpoint: Checkpoint) -> None:
        checkpoint.pins -= 1

    def plan_save(self, trunk: Trunk, resume: Checkpoint | None, at: int) -> PlannedSave | None:
        """Reserve a slot and pages for a checkpoint of `trunk` at `at`, extending `resume`; None if it cannot fit."""
        start = resume.length if resume is not None else 0
        if at <= start:
            return None
        slot = self._take_slot()
        if slot is None:
            return None
        pages: list[int] = []
        copies: list[tuple[int, int]] = []
        if resume is not None:
            pages = list(resume.pages[: start // PAGE])
            self._page_refs[pages] += 1
            if start % PAGE:
                old = resume.pages[start // PAGE]
                if self._page_fill[old] == start % PAGE:
                    self._page_refs[old] += 1
                    pages.append(old)
                else:
                    taken = self._take_pages(1)
                    if taken is None:
                        self._release(pages, slot)
                        return None
                    copies.append((old, taken[0]))
                    self._page_fill[taken[0]] = start % PAGE
                    pages += taken
        taken = self._take_pages(max(0, -(-at // PAGE) - len(pages)))
        if taken is None:
            self._release(pages, slot)
            return None
        pages += taken
        first = start // PAGE
        written = np.asarray(pages[first:], dtype=np.int64)  # pages this save writes entries of (from their start)
        self._page_fill[written] = np.maximum(self._page_fill[written],
                                              np.minimum(PAGE, at - np.arange(first, len(pages)) * PAGE))
        # the slots of the written pages, then those of positions [start, at) among them (not a division and a
        # remainder per position)
        kv_slots = (written[:, None] * PAGE + PAGE_SLOTS).ravel()[start - first * PAGE : at - first * PAGE]
        key = trunk.block_hash(at // BLOCK)
        checkpoint = Checkpoint(trunk.buffer, at, slot, pages, key)
        self.counters["page_copies"] += len(copies)
        return PlannedSave(checkpoint, start, kv_slots, copies, resume)

    def commit(self, save: PlannedSave) -> None:
        """Make a written checkpoint visible to lookups (its round is launched: device work is ordered), and
        drop the checkpoint it supersedes (same history, not shared with a fork, not in use)."""
        checkpoint = save.checkpoint
        self._lru[checkpoint] = None
        self._index.setdefault(checkpoint.key, []).append(checkpoint)
        self.counters["checkpoints_saved"] += 1
        base = save.base
        if (
            base is not None
            and base.buffer is checkpoint.buffer
            and base.length > base.buffer.shared_upto
            and base.pins == 0
            and base in self._lru
        ):
            self._evict(base)
            self.counters["superseded"] += 1

    def abort(self, save: PlannedSave) -> None:
        """Give back what a save reserved (its round failed)."""
        self._release(save.checkpoint.pages, save.checkpoint.slot)

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole pages (every attention layer, keys and values) on the device."""
        if not copies:
            return
        device = self._kv[0].tensor.device
        source, target = (torch.tensor(column, device=device) for column in zip(*copies))
        for kv in self._kv:
            paged = kv.tensor.view(self.num_pages + 1, PAGE, *kv.tensor.shape[1:])
            paged[target] = paged[source]

    def release(self) -> None:
        """Drop every checkpoint and free the device arenas (the engine is closed; nothing reads them again)."""
        for checkpoint in list(self._lru):
            self._evict(checkpoint)
        for memory in self._arenas():
            memory.release()
        self._kv = []
        self.num_slots = self.num_pages = 0
        self._free_slots, self._free_pages = [], []

    def clear(self) -> None:
        """Evict every checkpoint not in use by a running round."""
        for checkpoint in [c for c in self._lru if c.pins == 0]:
            self._evict(checkpoint)

    @property
    def trimmable(self) -> bool:
        """Whether `trim` should give memory back: a quarter of the backed slots or pages is in use, or less (a
        pool that doubled to fit is not trimmable at once)."""
        slots, pages = self._needed()
        backed_slots, backed_pages = self.backed
        return 4 * slots < backed_slots or 4 * pages < backed_pages

    def trim(self) -> None:
        """Give back the memory of slots and pages past twice the highest in use (call it with the device idle:
        no round in flight reads them)."""
        slots, pages = self._needed()
        keep_slots, keep_pages = min(self.backed[0], 2 * slots), min(self.backed[1], 2 * pages)
        self._free_slots = [slot for slot in self._free_slots if slot < keep_slots]
        self._free_pages = [page for page in self._free_pages if page < keep_pages]
        heapq.heapify(self._free_slots)
        heapq.heapify(self._free_pages)
        self._back(keep_slots, keep_pages)
        self._device_full = False

    # ------------------------------------------------------------------------------------- internals
    def _arenas(self) -> list[Arena]:
        return [self._states, self._windows, *self._kv]

    def _back(self, slots: int, pages: int) -> None:
        self._states.back(slots)
        self._windows.back(slots)
        for kv in self._kv:
            kv.back(pages * PAGE)

    def _needed(self) -> tuple[int, int]:
        """One past the highest slot and page in use."""
        backed_slots, backed_pages = self.backed
        free_slots = set(self._free_slots)
        slots = next((s + 1 for s in range(backed_slots - 1, -1, -1) if s not in free_slots), 0)
        in_use = np.flatnonzero(self._page_refs[:backed_pages])  # taken pages are referenced
        return slots, int(in_use[-1]) + 1 if len(in_use) else 0

    def _grow(self, slots: int = 0, pages: int = 0) -> bool:
        """Back at least `slots` more slots / `pages` more pages (doubling, within the cap); False at the cap, or
        when the device has no memory left for it (the pool then evicts, or saves no checkpoint: never an error)."""
        backed_slots, backed_pages = self.backed
        new_slots = backed_slots if not slots else min(self.num_slots, max(backed_slots + slots, 2 * backed_slots,
                                                                             GROW_SLOTS))
        new_pages = backed_pages if not pages else min(self.num_pages, max(backed_pages + pages, 2 * backed_pages,
                                                                             GROW_PAGES))
        if new_slots == backed_slots and new_pages == backed_pages or self._device_full:
            return False
        try:
            self._check_room((new_slots - backed_slots) * self.slot_bytes + (new_pages - backed_pages) * self.page_bytes)
            self._back(new_slots, new_pages)
        except DeviceMemoryFull:
            self._back(backed_slots, backed_pages)  # the arenas that grew give their new rows back (none in use)
            self._device_full = True
            self.counters["growth_refused"] += 1
            LOG.warning("the device has no memory left for the checkpoint pool to grow past %d slots and %d pages; "
                        "it evicts checkpoints for room instead", backed_slots, backed_pages)
            return False
        for slot in range(backed_slots, new_slots):
            heapq.heappush(self._free_slots, slot)
        for page in range(backed_pages, new_pages):
            heapq.heappush(self._free_pages, page)
        return True

    def _check_room(self, extra: int) -> None:
        """DeviceMemoryFull unless the device keeps DEVICE_HEADROOM free for the rounds (torch's cached, unused
        memory counts as free) after the pool takes `extra` more bytes."""
        if self.device.type != "cuda":
            return
        free, _ = torch.cuda.mem_get_info(self.device)
        cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        if free + cached - extra < DEVICE_HEADROOM:
            raise DeviceMemoryFull(f"growing the checkpoint pool by {extra} bytes would leave less than "
                                   f"{DEVICE_HEADROOM} bytes of device memory to the rounds")

    def _take_slot(self) -> int | None:
        while not self._free_slots:
            if not self._grow(slots=1) and not self._evict_oldest():
                return None
        return heapq.heappop(self._free_slots)

    def _take_pages(self, count: int) -> list[int] | None:
        """`count` free pages, the lowest first (growing the pool, or past its cap evicting the least recently
        used checkpoints for room), each referenced once and empty; None, taking nothing, if evicting every
        unpinned checkpoint leaves too few."""
        while len(self._free_pages) < count:
            if not self._grow(pages=count - len(self._free_pages)) and not self._evict_oldest():
                return None
        taken = [heapq.heappop(self._free_pages) for _ in range(count)]
        self._page_refs[taken] = 1
        self._page_fill[taken] = 0
        return taken

    def _evict_oldest(self) -> bool:
        victim = next((c for c in self._lru if c.pins == 0), None)
        if victim is None:
            return False
        self._evict(victim)
        self.counters["evictions"] += 1
        return True

    def _evict(self, checkpoint: Checkpoint) -> None:
        del self._lru[checkpoint]
        bucket = self._index[checkpoint.key]
        bucket.remove(checkpoint)
        if not bucket:
            del self._index[checkpoint.key]
        self._release(checkpoint.pages, checkpoint.slot)

    def _release(self, pages: list[int], slot: int) -> None:
        """Drop one reference to each of `pages` (distinct) and free the slot; pages left unreferenced are free."""
        page_array = np.asarray(pages, dtype=np.int64)
        self._page_refs[page_array] -= 1
        freed = page_array[self._page_refs[page_array] == 0]
        self._page_fill[freed] = 0
        for page in freed.tolist():
            heapq.heappush(self._free_pages, page)
        heapq.heappush(self._free_slots, slot)
