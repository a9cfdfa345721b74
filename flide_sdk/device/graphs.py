"""CUDA-graph execution of rounds: captured forwards per capacity, fed from pinned staging buffers.

The model's forward is captured for each capacity of the ladder (`capacity.py`), one capacity per `capture_next`
call in `capture_order`, all in one memory pool (only one graph runs at a time): the round thread captures between
rounds while the engine already serves, rounds that fit no captured capacity yet running eagerly as their graph
would (`run_eagerly`: the same staging and kernels). Each graph reads its round from views of ONE device int64
buffer, laid out per capacity (`StagingLayout`). A round is launched by staging its host arrays straight into a
pinned staging buffer and one replay, which copies that buffer into the device buffer, runs the forward and copies
the label log-probabilities (and the text reads') into a pinned readback buffer; `Launch.wait()`
later synchronises on an event recorded after it. A round with text-scored options replays its capacity's twin with
read rows (`capacity.text_capacity`), captured the first time a round needs it, so label-only rounds never run the
read path. Two staging/readback buffer pairs alternate, so the host can build round k+1 while the device still runs
round k (docs/decisions/round-planning.md): a capacity has one graph per pair, the copies inside it (a launch is
one call; the pair's second graph takes capture time, not memory: it reuses the first one's blocks of the pool).
The staging buffer holds a round's staged form (`RoundPlan.stage`): the arrays that grow with the stream (token
rows, conv sources, chunk tables, save windows) come as a piece table, chunk spans and save tokens, which the
graph's first kernel expands into device arrays of their own (`device_round`, `kernels.round_metadata`).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from flide_sdk.kernels.plans import RoundMetadata
from flide_sdk.models.ops import Ops
from flide_sdk.models.qwen35 import LayerCache, Qwen35Model
from flide_sdk.plan.capacity import Capacity, capture_order, choose, text_capacity
from flide_sdk.plan.layout import (
    Branches,
    HostRound,
    RequestSpec,
    RoundPlan,
    RoundTensors,
    StateRows,
    TextReads,
    plan_round,
    round_tensors,
)

LOG = logging.getLogger(__name__)
BUFFERS = 2  # staging/readback buffers in rotation: rounds that may be in flight at once


class FlatLayout:
    """Where each of a set of named int64 arrays lives in one flat buffer (a capacity's staging buffer, or the
    device arrays its staged round is expanded into)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        self.fields: dict[str, tuple[int, tuple[int, ...]]] = {}
        offset = 0
        for name, shape in shapes.items():
            self.fields[name] = (offset, shape)
            offset += int(np.prod(shape))
        self.elements = offset

    def views(self, flat: torch.Tensor | np.ndarray) -> dict:
        """Views of `flat` (a device tensor or a host array), shaped and named as the layout's arrays."""
        return {name: flat[offset : offset + int(np.prod(shape))].reshape(shape)
                for name, (offset, shape) in self.fields.items()}


class StagingLayout(FlatLayout):
    """A capacity's staging buffer (`RoundShape.staged_shapes`)."""

    def __init__(self, capacity: Capacity) -> None:
        super().__init__(capacity.shape.staged_shapes())
        self.capacity = capacity


def device_round(
    capacity: Capacity,
    staged: dict[str, torch.Tensor],
    expanded: dict[str, torch.Tensor],
    expansion: Callable[..., None] | None = None,
) -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
    """The device arrays a graph's forward reads (named as `HostRound.arrays()`), from views of the staging
    copy (`staged`) and of the expansion's arrays (`expanded`, `RoundShape.expanded_shapes`), and the call that
    expands the one into the other (`kernels.round_metadata`; `expansion` its kernel, the default, or its
    reference). The kernel module is imported here: a CPU install has no Triton."""
    from flide_sdk.kernels.round_metadata import expand_round_triton

    arrays = {**staged, **expanded}
    metadata = RoundMetadata(**{name: arrays[name] for name in RoundMetadata._fields})
    return arrays, functools.partial(expansion or expand_round_triton, metadata)


def placeholder_round(conv_kernel: int, rows: StateRows, kv_sink: int, sliding: bool) -> HostRound:
    """The round graphs are captured on: one request of a one-token trunk and one one-token question."""
    token = np.zeros(1, np.int64)
    return plan_round([RequestSpec(token, Branches.of([token], [token]))], conv_kernel, rows, kv_sink,
                      sliding=sliding)


@dataclass
class _Captured:
    graphs: list[torch.cuda.CUDAGraph]  # per buffer pair: staging buffer -> forward -> readback buffer
    host_views: list[dict[str, np.ndarray]]  # per pinned staging buffer
    label_logprobs: list[np.ndarray]  # per pinned readback buffer: its [questions, labels] head
    text_logprobs: list[np.ndarray]  # per pinned readback buffer: the text reads' log-probabilities after it


class Launch:
    """A round on its way through the device; `wait()` returns its log-probabilities [questions, labels] (a
    text-scored question's row from its reads, `TextReads.scores`)."""

    def __init__(self, label_logprobs: np.ndarray, text_logprobs: np.ndarray, reads: TextReads,
                 events: Sequence[torch.cuda.Event], capacity: Capacity, host_seconds: dict[str, float],
                 started_at: float) -> None:
        self._label_logprobs, self._text_logprobs, self._reads = label_logprobs, text_logprobs, reads
        self._events = events  # before and after the replay (copies in and out included)
        self.capacity = capacity
        self.host_seconds = host_seconds  # host time of the launch's parts (`GraphRunner.launch`)
        self.started_at = started_at  # time.perf_counter() when the replay was issued

    def done(self) -> bool:
        """Whether the device has finished the round (its log-probabilities are on the host); never blocks."""
        return self._events[-1].query()

    def wait(self) -> np.ndarray:
        self._events[-1].synchronize()
        return self._reads.scores(self._label_logprobs, self._text_logprobs)

    def device_seconds(self) -> dict[str, float]:
        """GPU time of the replay, its copy in and its readback included (call after `wait`)."""
        started, finished = self._events
        return {"replay_seconds": started.elapsed_time(finished) / 1000}


@dataclass(frozen=True)
class CaptureReport:
    capacities: int  # capacities captured (each with a graph per buffer pair)
    seconds: float
    memory_bytes: int
    text: bool  # a capacity with text reads (captured on need, not a rung of the ladder)


class GraphRunner:
    """The captured forwards of one model, and the staging that feeds them."""

    def __init__(
        self,
        model: Qwen35Model,
        ops: Ops,
        caches: Sequence[LayerCache],
        ladder: Sequence[Capacity],
        rows: StateRows,
        window_sink: int,
        kv_sink: int,
    ) -> None:
        self.model, self.ops, self.caches = model, ops, caches
        self.ladder = sorted(ladder, key=lambda c: c.tokens)
        # what a round may replay: the ladder, and each rung's twin with text reads, captured on first need
        self._choices = sorted(self.ladder + [text_capacity(c) for c in self.ladder],
                               key=lambda c: (c.tokens, c.text_reads))
        self.rows, self.window_sink, self.kv_sink = rows, window_sink, kv_sink
        self.device = model.embed_tokens.weight.device
        self._layouts = {capacity: StagingLayout(capacity) for capacity in self._choices}
        elements = max(layout.elements for layout in self._layouts.values())
        readback = max(c.questions * c.labels + c.text_reads for c in self._choices)
        self._device_buffer = torch.zeros(elements, dtype=torch.int64, device=self.device)
        expanded_layouts = {c: FlatLayout(c.shape.expanded_shapes()) for c in self._choices}
        expanded_buffer = torch.zeros(max(layout.elements for layout in expanded_layouts.values()),
                                      dtype=torch.int64, device=self.device)
        # per capacity: the device arrays its forward reads and the call expanding them (graph or eager)
        self._device_rounds = {c: device_round(c, self._layouts[c].views(self._device_buffer),
                                               expanded_layouts[c].views(expanded_buffer)) for c in self._choices}
        self._staging = [torch.zeros(elements, dtype=torch.int64).pin_memory() for _ in range(BUFFERS)]
        self._readback = [torch.zeros(readback, dtype=torch.float32).pin_memory() for _ in range(BUFFERS)]
        self._replayed: list[torch.cuda.Event | None] = [None] * BUFFERS
        # per buffer pair: before and after its replay; reused by the round after next, which starts only
        # after the engine waited for this one (its readback), so the pair is free by then (`_replayed`)
        self._events = [[torch.cuda.Event(enable_timing=True) for _ in range(2)] for _ in range(BUFFERS)]
        self._next = 0
        self._captured: dict[Capacity, _Captured] = {}
        self._compiled: set[Capacity] = set()  # capacities whose kernels were compiled (`_compile`)
        self._pool = torch.cuda.graph_pool_handle()  # shared by every graph: one runs at a time
        # the stream of every capture's warm-up: one, since cuBLAS keeps a workspace per stream it ran on
        self._side = torch.cuda.Stream(self.device)
        self._pending = capture_order(self.ladder)
        self._gave_up = False

    @property
    def pending(self) -> list[Capacity]:
        """The capacities not captured yet, in the order `capture_next` takes them (`capture_order`); none once
        capturing was given up (`give_up`)."""
        return self._pending

    @property
    def captured(self) -> int:
        """How many capacities of the ladder have their graph (text capacities not counted)."""
        return sum(1 for capacity in self._captured if not capacity.text_reads)

    def give_up(self) -> None:
        """Capture nothing more: rounds past the captured capacities run eagerly."""
        self._pending = []
        self._gave_up = True

    def run_eagerly(self, plan: RoundPlan) -> np.ndarray | None:
        """A round whose graph is not captured yet, run as its graph would run it but without the graph: staged
        and copied into the device buffer, expanded by the same kernel, the forward at its capacity's shape (the
        kernels the graph's capture compiles); its log-probabilities, or None past the largest capacity."""
        capacity = choose(self._choices, plan)
        if capacity is None:
            return None
        buffer = self._free_buffer()
        plan.stage(self._layouts[capacity].views(self._staging[buffer].numpy()), capacity.shape, self.window_sink)
        self._copy_in(buffer, capacity)
        arrays, expand = self._device_rounds[capacity]
        rnd = round_tensors(plan, capacity.shape, arrays)
        self._compile(capacity, expand, rnd)
        expand()
        readout = self.model(rnd, self.ops, self.caches)
        return plan.text_reads.scores(readout.label_logprobs[: plan.num_questions].cpu().numpy(),
                                      readout.text_logprobs.cpu().numpy())

    def capture_next(self) -> CaptureReport:
        """Capture the next pending capacity's graphs (one per buffer pair) on a placeholder round, in the
        runner's one memory pool (only one graph runs at a time). Call it with no round in flight; rounds that
        fit no captured capacity meanwhile run eagerly (`launch` returns None)."""
        capacity = self.pending[0]
        torch.cuda.synchronize(self.device)
        # the memory a graph adds is its pool's: the warm-up's blocks (and the eager rounds' before it) are
        # given back to the device first, not counted in and not kept for a stream nothing else runs on
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved(self.device)
        started = time.perf_counter()
        LOG.debug("capturing the round graph of %d tokens", capacity.tokens)
        layout = self._layouts[capacity]
        placeholder = placeholder_round(capacity.conv_kernel, self.rows, self.kv_sink, capacity.sliding).plan
        host_views = [layout.views(buffer.numpy()) for buffer in self._staging]
        for views in host_views:
            placeholder.stage(views, capacity.shape, self.window_sink)
        self._copy_in(0, capacity)
        arrays, expand = self._device_rounds[capacity]
        rnd = round_tensors(placeholder, capacity.shape, arrays)
        side = self._side
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._compile(capacity, expand, rnd)
            expand()
            self.model(rnd, self.ops, self.caches)  # warm-up: sizes workspaces (and compiles what is left)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        size = capacity.questions * capacity.labels
        readback = [buffer[:size].view(capacity.questions, capacity.labels) for buffer in self._readback]
        text_readback = [buffer[size : size + capacity.text_reads] for buffer in self._readback]
        graphs = []
        for buffer in range(BUFFERS):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._copy_in(buffer, capacity)
                expand()
                readout = self.model(rnd, self.ops, self.caches)
                readback[buffer].copy_(readout.label_logprobs, non_blocking=True)
                if capacity.text_reads:
                    text_readback[buffer].copy_(readout.text_logprobs, non_blocking=True)
            graphs.append(graph)
        torch.cuda.synchronize(self.device)
        self._captured[capacity] = _Captured(graphs, host_views, [view.numpy() for view in readback],
                                             [view.numpy() for view in text_readback])
        self._pending.remove(capacity)
        return CaptureReport(1, time.perf_counter() - started, torch.cuda.memory_reserved(self.device) - reserved,
                             bool(capacity.text_reads))

    def launch(self, plan: RoundPlan) -> Launch | None:
        """Stage a round and replay the smallest capacity's graph it fits (its copies in and out included); None
        if that one is not captured (or there is none): run it eagerly (`run_eagerly`)."""
        capacity = choose(self._choices, plan)
        if capacity is None or capacity not in self._captured:
            if capacity is not None and capacity.text_reads and capacity not in self._pending and not self._gave_up:
                self._pending.append(capacity)  # a text capacity is captured once a round needs it
            return None
        captured = self._captured[capacity]
        started = time.perf_counter()
        buffer = self._free_buffer()
        freed = time.perf_counter()
        plan.stage(captured.host_views[buffer], capacity.shape, self.window_sink)
        padded = time.perf_counter()
        events = self._events[buffer]
        events[0].record()
        captured.graphs[buffer].replay()
        events[1].record()
        self._replayed[buffer] = events[1]
        replayed = time.perf_counter()
        host_seconds = {"buffer_wait_seconds": freed - started, "pad_seconds": padded - freed,
                        "replay_call_seconds": replayed - padded}
        return Launch(captured.label_logprobs[buffer][: plan.num_questions], captured.text_logprobs[buffer],
                      plan.text_reads, events, capacity, host_seconds, padded)

    def _compile(self, capacity: Capacity, expand: Callable[[], None], rnd: RoundTensors) -> None:
        """Compile the kernels of a capacity's forward in parallel (`compile_ahead`), the first time it runs."""
        from flide_sdk.kernels.compile_ahead import compile_ahead  # a CPU install has no Triton

        def forward() -> None:
            expand()
            self.model(rnd, self.ops, self.caches)

        if capacity not in self._compiled:
            compile_ahead(forward)
            self._compiled.add(capacity)

    def _free_buffer(self) -> int:
        """The next staging/readback buffer pair, once the round that used it last is done."""
        buffer = self._next
        self._next = (self._next + 1) % BUFFERS
        if self._replayed[buffer] is not None:
            self._replayed[buffer].synchronize()
        return buffer

    def _copy_in(self, buffer: int, capacity: Capacity) -> None:
        """Queue the copy of a staged round (its capacity's head of a pinned buffer) into the device buffer."""
        elements = self._layouts[capacity].elements
        self._device_buffer[:elements].copy_(self._staging[buffer][:elements], non_blocking=True)
