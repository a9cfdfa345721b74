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
the ones in use stay at the start. Sliding-window attention layers have pages of their own (`PageKind`: their
arenas, free list, reference counts and fill marks): a checkpoint refers to full-attention pages for its whole
history and to sliding pages only from the page its window starts in (`StateLayout.sliding_from`), its table's
entries before that pointing at the sink page (the attention skips those blocks, and masks what it reads of
them); a checkpoint that extends another takes no reference to the sliding pages its window has left, so they
are freed with the checkpoint it supersedes. The kinds share the byte cap, not a page count: a long history
holds many full pages and a window's few sliding ones, so each kind grows (and trims) on its own while their
pages together stay within the cap. Their arenas address the same page range, so they share the sink page's
index. The host keeps the bookkeeping (free lists, reference counts, fill marks, the hash index) and hands the
round planner plain integer tables. Past the checkpoint slots, the state arena has an always-zero row and up to
`scratch_rows` rows where a round keeps its trunks' states (`layout.StateRows`), so a round reads and saves
states in place; the scratch rows are held by need too (a lone ask uses one; a round takes what it needs before
it is planned, and keeps to the rows held when the device has no memory for more). The window arena has one
sink slot and the key/value arenas one sink page, where padded saves of a fixed-shape round go.
"""

from __future__ import annotations

import heapq
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from flide_sdk.device.arena import Arena, DeviceMemoryFull, PlainArena, arena, holds_on_demand
from flide_sdk.models.qwen35 import LayerCache
from flide_sdk.models.state import KeyValueShape, RecurrentShape, StateLayout
from flide_sdk.plan.layout import PAGE, StateRows
from flide_sdk.text.history import BLOCK, TokenBuffer, Trunk

PAGE_SLOTS = np.arange(PAGE, dtype=np.int64)  # offsets of a page's entries from its first
GROW_PAGES, GROW_SLOTS = 64, 4  # the least a growing pool adds (it doubles past these)
DEVICE_HEADROOM = 1 << 30  # device memory a growing pool leaves to the rounds' own allocations

LOG = logging.getLogger(__name__)


@dataclass(eq=False)
class Checkpoint:
    """Model state after tokens [0, length) of `buffer`: its slot, its full-attention pages and its sliding pages
    (one entry per page of the history, the sink page before its window; empty without sliding layers)."""

    buffer: TokenBuffer
    length: int
    slot: int
    pages: list[int]
    key: int  # chained hash of the first length // BLOCK blocks
    pins: int = 0
    sliding_pages: list[int] = field(default_factory=list)


@dataclass(eq=False)
class PlannedSave:
    """A checkpoint to be written by a round: the pool slot, and per page kind the flat KV slots of positions
    [start, at) and the pages to copy first (copy-on-write of a shared partial page: source, target)."""

    checkpoint: Checkpoint
    start: int
    kv_slots: np.ndarray
    page_copies: list[tuple[int, int]] = field(default_factory=list)
    base: Checkpoint | None = None  # the checkpoint it extends
    sliding_kv_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    sliding_copies: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class PageTable:
    """One kind's pages of a planned checkpoint: its table, the flat slots of the positions it writes, its
    copies."""

    pages: list[int]
    kv_slots: np.ndarray
    copies: list[tuple[int, int]]


class PageKind:
    """The pages of one kind of attention layer (full or sliding-window): per layer keeping its own, a key and a
    value arena of `pages` pages plus the sink page; per page its references and fill mark; the free heap of
    the backed pages. `limit`: the most pages it may back (those of `page_budget` bytes, within `pages`)."""

    def __init__(self, shapes: list[KeyValueShape], pages: int, page_budget: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.layers = [kv.layer for kv in shapes]
        self.page_bytes = PAGE * sum(2 * kv.heads * kv.head_dim for kv in shapes) * dtype.itemsize
        self.sink = pages
        self.limit = min(pages, page_budget // self.page_bytes) if self.page_bytes else pages
        self.arenas = [arena((pages + 1) * PAGE, (kv.heads, kv.head_dim), dtype, device, pages * PAGE)
                       for kv in shapes for _ in range(2)]  # per layer: keys, values
        self.refs = np.zeros(pages, dtype=np.int64)
        self.fill = np.zeros(pages, dtype=np.int64)  # entries written from the page start
        self.free: list[int] = []

    @property
    def backed(self) -> int:
        return self.arenas[0].backed // PAGE if self.arenas else 0

    @property
    def in_use(self) -> int:
        return self.backed - len(self.free)

    def back(self, pages: int) -> None:
        for memory in self.arenas:
            memory.back(pages * PAGE)

    def needed(self) -> int:
        """One past the highest page in use (taken pages are referenced)."""
        in_use = np.flatnonzero(self.refs[: self.backed])
        return int(in_use[-1]) + 1 if len(in_use) else 0

    def take(self, count: int) -> list[int]:
        """`count` free pages (there are), the lowest first, each referenced once and empty."""
        taken = [heapq.heappop(self.free) for _ in range(count)]
        self.refs[taken] = 1
        self.fill[taken] = 0
        return taken

    def release(self, pages: list[int]) -> None:
        """Drop one reference to each of `pages` (distinct; the sink's entries skipped); unreferenced pages are
        free."""
        page_array = np.asarray(pages, dtype=np.int64)
        page_array = page_array[page_array != self.sink]
        self.refs[page_array] -= 1
        freed = page_array[self.refs[page_array] == 0]
        self.fill[freed] = 0
        for page in freed.tolist():
            heapq.heappush(self.free, page)

    def copy(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole pages (every layer of the kind, keys and values) on the device."""
        if not copies or not self.arenas:
            return
        device = self.arenas[0].tensor.device
        source, target = (torch.tensor(column, device=device) for column in zip(*copies))
        for memory in self.arenas:
            paged = memory.tensor.view(self.sink + 1, PAGE, *memory.tensor.shape[1:])
            paged[target] = paged[source]


@dataclass(frozen=True)
class PageUsage:
    """Per KV page: how many checkpoints reference it and how many entries are written from its start."""

    refs: np.ndarray
    fill: np.ndarray
    free: list[int]


class ModelConfig(Protocol):
    """What the pool reads of a model's config: what its checkpoints hold per layer."""

    def state_layout(self) -> StateLayout: ...


def page_range(page_budget: int, kind_bytes: list[int], on_demand: bool) -> int:
    """How many pages every kind's arenas address (one range: the kinds share the sink page's index). Arenas that
    hold memory on demand address as many as the budget holds of the smallest kind's pages (the cap is kept as
    they grow); arenas allocated whole address as many as it holds of one page of every kind (what they take)."""
    kind_bytes = [size for size in kind_bytes if size]
    if not kind_bytes:
        return 0
    return page_budget // (min(kind_bytes) if on_demand else sum(kind_bytes))


def session_bytes(config: ModelConfig, dtype: torch.dtype, tokens: int) -> int:
    """Key/value bytes a checkpoint of `tokens` tokens holds on its own (sliding layers keeping their window's
    pages)."""
    layout = config.state_layout()
    return layout.checkpoint_bytes(tokens, dtype) - layout.slot_bytes(dtype)


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
        self.page_bytes = PAGE * layout.token_bytes(dtype)  # a page of each kind
        if self.slot_bytes:
            wanted = max_checkpoints if max_checkpoints is not None else max(4, int(0.25 * budget_bytes) // self.slot_bytes)
            slots = min(wanted, budget_bytes // self.slot_bytes)  # a zero budget disables checkpoints
        else:  # no recurrent state (attention only): a checkpoint is its pages, one at least
            slots = budget_bytes // self.page_bytes
            slots = slots if max_checkpoints is None else min(slots, max_checkpoints)
        self.page_budget = budget_bytes - slots * self.slot_bytes  # the pages of every kind together
        full = [kv for kv in layout.key_values if kv.window is None]
        sliding = [kv for kv in layout.key_values if kv.window is not None]
        kind_bytes = [PAGE * layout.token_bytes(dtype, sliding=False), PAGE * layout.token_bytes(dtype, sliding=True)]
        pages = page_range(self.page_budget, kind_bytes, holds_on_demand(device))
        self.num_slots, self.num_pages = slots, pages  # at most, within the cap
        self.max_scratch = scratch_rows
        self.window_sink = slots
        self.kv_sink = pages * PAGE
        # without recurrent layers the state and window arenas have rows of no elements (slots stay bookkeeping);
        # past the slots, the zero row and the scratch rows, GROW_SLOTS of them held at rest
        shape = layout.recurrent or RecurrentShape(1, 1, 1, 1, 1)
        self._resting_scratch = min(GROW_SLOTS, scratch_rows)
        self._states = arena(slots + 1 + scratch_rows, (len(self.gdn_layers), shape.heads, shape.key_dim,
                                                        shape.value_dim), torch.float32, device, slots,
                             1 + self._resting_scratch)
        self._windows = arena(slots + 1, (len(self.gdn_layers), shape.conv_kernel - 1, shape.conv_dim), dtype, device,
                              slots)
        self._full = PageKind(full, pages, self.page_budget, dtype, device)
        self._sliding = PageKind(sliding, pages, self.page_budget, dtype, device) if sliding else None
        self.sliding = self._sliding is not None  # whether rounds stage the sliding layers' page tables
        self._free_slots: list[int] = []  # the heap of the free slots among the backed ones
        self._lru: OrderedDict[Checkpoint, None] = OrderedDict()
        self._index: dict[int, list[Checkpoint]] = {}
        self.counters = {"checkpoints_saved": 0, "evictions": 0, "superseded": 0, "page_copies": 0,
                         "growth_refused": 0}
        self._device_full = False  # the device refused to back more rows: grow no more until memory is given back

    # -------------------------------------------------------------------------------------- queries
    @property
    def capacity_bytes(self) -> int:
        """The cap: what the pool's slots and pages may take at most."""
        return self.num_slots * self.slot_bytes + self.page_budget

    @property
    def state_rows(self) -> StateRows:
        """The state arena's rows a round may use: the slots, the zero row and the scratch rows held now."""
        return StateRows(zero=self.num_slots, scratch=self.num_slots + 1, scratch_count=self.scratch_held)

    @property
    def scratch_held(self) -> int:
        """Scratch rows held now (past the zero row in the state arena's tail)."""
        return self._states.tail_held - 1

    def hold_scratch(self, rows: int) -> bool:
        """Hold at least `rows` scratch rows, where rounds keep their trunks' states (doubling, up to
        `max_scratch`); False if there are not that many or the device has no memory left for them."""
        held = self.scratch_held
        if rows <= held:
            return True
        if rows > self.max_scratch or self._device_full:
            return False
        wanted = min(self.max_scratch, max(rows, 2 * held))
        try:
            self._check_room((wanted - held) * self._states.row_bytes)
            self._states.back_tail(1 + wanted)
        except DeviceMemoryFull:
            self._refused("the device has no memory left for %d scratch state rows; rounds keep to %d", wanted, held)
            return False
        return True

    @property
    def kinds(self) -> list[PageKind]:
        return [self._full] + ([self._sliding] if self._sliding is not None else [])

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
        """Slots and full-attention pages that hold memory now."""
        return self._states.backed, self._full.backed

    @property
    def pages_in_use(self) -> tuple[int, int]:
        """Full-attention and sliding-window pages referenced by checkpoints (or reserved by a round)."""
        return self._full.in_use, 0 if self._sliding is None else self._sliding.in_use

    @property
    def used_bytes(self) -> int:
        return len(self._lru) * self.slot_bytes + sum(kind.in_use * kind.page_bytes for kind in self.kinds)

    @property
    def num_checkpoints(self) -> int:
        return len(self._lru)

    def checkpoints(self) -> list[Checkpoint]:
        """The checkpoints held, least recently used first."""
        return list(self._lru)

    def page_usage(self) -> PageUsage:
        """A copy of the full-attention pages' bookkeeping: references and entries written per page, and the free
        pages."""
        full = self._full
        free = sorted(full.free) + list(range(full.backed, full.limit))  # unbacked pages are free too
        return PageUsage(full.refs.copy(), full.fill.copy(), free)

    def layer_caches(self) -> list[LayerCache]:
        """Per model layer, its views of the arenas (what the model's forward takes as `caches`): a layer that reads
        another's keys and values gets that layer's."""
        caches: dict[int, LayerCache] = {}
        for index, layer in enumerate(self.gdn_layers):
            caches[layer] = (self._states.tensor[:, index], self._windows.tensor[:, index])
        for kind in self.kinds:
            for index, layer in enumerate(kind.layers):
                caches[layer] = (kind.arenas[2 * index].tensor, kind.arenas[2 * index + 1].tensor)
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
        full = self._plan_pages(self._full, resume.pages if resume is not None else [], start, at, 0)
        if full is None:
            heapq.heappush(self._free_slots, slot)
            return None
        sliding = PageTable([], np.zeros(0, dtype=np.int64), [])
        if self._sliding is not None:
            planned = self._plan_pages(self._sliding, resume.sliding_pages if resume is not None else [], start, at,
                                       self.layout.sliding_from(at))
            if planned is None:
                self._release(full.pages, [], slot)
                return None
            sliding = planned
        key = trunk.block_hash(at // BLOCK)
        checkpoint = Checkpoint(trunk.buffer, at, slot, full.pages, key, sliding_pages=sliding.pages)
        self.counters["page_copies"] += len(full.copies) + len(sliding.copies)
        return PlannedSave(checkpoint, start, full.kv_slots, full.copies, resume, sliding.kv_slots, sliding.copies)

    def _plan_pages(self, kind: PageKind, inherited: list[int], start: int, at: int, keep_from: int) -> PageTable | None:
        """The page table of one kind for a checkpoint at `at` extending one of `start` tokens (`inherited` its
        table): pages [0, keep_from) the sink (not kept), the rest the inherited pages (referenced once more; a
        partial last page copied unless nobody wrote past its fill) and new ones; None, holding nothing, if the
        pool cannot find the pages."""
        first = start // PAGE
        kept = list(inherited[keep_from:first])  # keep_from is at least the inherited table's (at > start)
        pages = [kind.sink] * min(keep_from, first) + kept
        kind.refs[kept] += 1
        copies: list[tuple[int, int]] = []
        if start % PAGE:
            if first < keep_from:
                pages.append(kind.sink)
            else:
                old = inherited[first]
                if kind.fill[old] == start % PAGE:
                    kind.refs[old] += 1
                    pages.append(old)
                else:
                    if not self._reserve(kind, 1):
                        kind.release(pages)
                        return None
                    taken = kind.take(1)
                    copies.append((old, taken[0]))
                    kind.fill[taken[0]] = start % PAGE
                    pages += taken
        blocks = -(-at // PAGE)
        skipped = max(0, min(keep_from, blocks) - len(pages))  # new pages before the window: the sink
        if not self._reserve(kind, blocks - len(pages) - skipped):
            kind.release(pages)
            return None
        pages += [kind.sink] * skipped + kind.take(blocks - len(pages) - skipped)
        written = np.asarray(pages[first:], dtype=np.int64)  # pages this save writes entries of (from their start)
        real = written != kind.sink
        kind.fill[written[real]] = np.maximum(kind.fill[written[real]],
                                              np.minimum(PAGE, at - np.arange(first, len(pages))[real] * PAGE))
        # the slots of the written pages, then those of positions [start, at) among them (not a division and a
        # remainder per position)
        kv_slots = (written[:, None] * PAGE + PAGE_SLOTS).ravel()[start - first * PAGE : at - first * PAGE]
        return PageTable(pages, kv_slots, copies)

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
        checkpoint = save.checkpoint
        self._release(checkpoint.pages, checkpoint.sliding_pages, checkpoint.slot)

    def copy_pages(self, saves: list[PlannedSave]) -> None:
        """The copies-on-write of `saves`' partial pages, every attention layer of each kind, on the device."""
        self._full.copy([copy for save in saves for copy in save.page_copies])
        if self._sliding is not None:
            self._sliding.copy([copy for save in saves for copy in save.sliding_copies])

    def release(self) -> None:
        """Drop every checkpoint and free the device arenas (the engine is closed; nothing reads them again)."""
        for checkpoint in list(self._lru):
            self._evict(checkpoint)
        for memory in self._arenas():
            memory.release()
        for kind in self.kinds:
            kind.arenas, kind.free = [], []
        self.num_slots = self.num_pages = self.page_budget = 0
        self._free_slots = []

    def clear(self) -> None:
        """Evict every checkpoint not in use by a running round."""
        for checkpoint in [c for c in self._lru if c.pins == 0]:
            self._evict(checkpoint)

    @property
    def trimmable(self) -> bool:
        """Whether `trim` should give memory back: a quarter of the backed slots or pages is in use, or less (a
        pool that doubled to fit is not trimmable at once)."""
        return (4 * self._needed_slots() < self.backed[0] or self.scratch_held > self._resting_scratch
                or any(4 * kind.needed() < kind.backed for kind in self.kinds))

    def trim(self) -> None:
        """Give back the memory of slots and pages past twice the highest in use, and of the scratch rows past the
        first GROW_SLOTS (call it with the device idle: no round in flight reads them)."""
        self._states.back_tail(1 + self._resting_scratch)
        keep_slots = min(self.backed[0], 2 * self._needed_slots())
        self._free_slots = [slot for slot in self._free_slots if slot < keep_slots]
        heapq.heapify(self._free_slots)
        self._states.back(keep_slots)
        self._windows.back(keep_slots)
        for kind in self.kinds:
            keep = min(kind.backed, 2 * kind.needed())
            kind.free = [page for page in kind.free if page < keep]
            heapq.heapify(kind.free)
            kind.back(keep)
        self._device_full = False

    # ------------------------------------------------------------------------------------- internals
    def _arenas(self) -> list[Arena]:
        return [self._states, self._windows, *(memory for kind in self.kinds for memory in kind.arenas)]

    def _needed_slots(self) -> int:
        """One past the highest slot in use."""
        free_slots = set(self._free_slots)
        return next((s + 1 for s in range(self.backed[0] - 1, -1, -1) if s not in free_slots), 0)

    def _grow(self, slots: int = 0, pages: int = 0, kind: PageKind | None = None) -> bool:
        """Back at least `slots` more slots / `pages` more pages of `kind` (doubling, within the cap: the pages of
        every kind together within `page_budget`); False at the cap, or when the device has no memory left for it
        (the pool then evicts, or saves no checkpoint: never an error)."""
        backed_slots = self.backed[0]
        backed_pages = kind.backed if kind is not None else 0
        new_slots = backed_slots if not slots else min(self.num_slots, max(backed_slots + slots, 2 * backed_slots,
                                                                             GROW_SLOTS))
        new_pages = backed_pages
        if pages:  # what it needs, and ahead of need at most half the room the other kind has left it
            room = self.page_budget - sum(other.backed * other.page_bytes for other in self.kinds if other is not kind)
            most, need = min(kind.limit, room // kind.page_bytes), backed_pages + pages
            ahead = min(max(0, max(2 * backed_pages, GROW_PAGES) - need), max(0, most - need) // 2)
            new_pages = max(backed_pages, min(most, need + ahead))
        if new_slots == backed_slots and new_pages == backed_pages or self._device_full:
            return False
        page_bytes = kind.page_bytes if kind is not None else 0
        try:
            self._check_room((new_slots - backed_slots) * self.slot_bytes + (new_pages - backed_pages) * page_bytes)
            self._states.back(new_slots)
            self._windows.back(new_slots)
            if kind is not None:
                kind.back(new_pages)
        except DeviceMemoryFull:
            self._states.back(backed_slots)  # the arenas that grew give their new rows back (none in use)
            self._windows.back(backed_slots)
            if kind is not None:
                kind.back(backed_pages)
            self._refused("the device has no memory left for the checkpoint pool to grow past %d slots and %d pages; "
                          "it evicts checkpoints for room instead", backed_slots, backed_pages)
            return False
        for slot in range(backed_slots, new_slots):
            heapq.heappush(self._free_slots, slot)
        if kind is not None:
            for page in range(backed_pages, new_pages):
                heapq.heappush(kind.free, page)
        return True

    def _refused(self, message: str, *args: int) -> None:
        """The device refused a growth: grow no more until a trim gives memory back; counted and logged."""
        self._device_full = True
        self.counters["growth_refused"] += 1
        LOG.warning(message, *args)

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

    def _reserve(self, kind: PageKind, count: int) -> bool:
        """Whether `count` pages of `kind` are free, growing the pool, or past its cap evicting the least recently
        used checkpoints for room; False if evicting every unpinned checkpoint leaves too few."""
        while len(kind.free) < count:
            if not self._grow(pages=count - len(kind.free), kind=kind) and not self._evict_oldest():
                return False
        return True

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
        self._release(checkpoint.pages, checkpoint.sliding_pages, checkpoint.slot)

    def _release(self, pages: list[int], sliding_pages: list[int], slot: int) -> None:
        """Drop one reference to each of `pages` and `sliding_pages` and free the slot; pages left unreferenced
        are free."""
        self._full.release(pages)
        if self._sliding is not None:
            self._sliding.release(sliding_pages)
        heapq.heappush(self._free_slots, slot)
