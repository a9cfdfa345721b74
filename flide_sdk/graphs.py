"""CUDA-graph execution of rounds: one captured forward per capacity, fed from one pinned staging buffer.

At engine start `GraphRunner.capture()` captures the model's forward once per capacity of the ladder
(`capacity.py`), largest first, all in one memory pool (only one graph runs at a time). Each graph reads
its round from views of ONE device int64 buffer, laid out per capacity (`StagingLayout`). A round is
launched by padding its host arrays straight into a pinned host buffer with the same layout, one
non-blocking host-to-device copy, the replay, and one non-blocking device-to-host copy of the label
probabilities into pinned memory; `Launch.wait()` later synchronises on that copy only. Two staging and two
readback buffers alternate, so the host can build round k+1 while the device still runs round k.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from flide_sdk.capacity import Capacity, choose, pad_into
from flide_sdk.layout import Branches, HostRound, RequestSpec, StateRows, plan_round
from flide_sdk.models.qwen35 import LayerCache, Qwen35Model
from flide_sdk.ops import Ops

LOG = logging.getLogger(__name__)
BUFFERS = 2  # staging/readback buffers in rotation: rounds that may be in flight at once


class StagingLayout:
    """Where each array of a round of one capacity lives in the flat int64 staging buffer."""

    def __init__(self, capacity: Capacity) -> None:
        self.capacity = capacity
        self.fields: dict[str, tuple[int, tuple[int, ...]]] = {}
        offset = 0
        for name, shape in capacity.shapes().items():
            self.fields[name] = (offset, shape)
            offset += int(np.prod(shape))
        self.elements = offset

    def views(self, flat: torch.Tensor | np.ndarray) -> dict:
        """Views of `flat` (a device tensor or a host array) shaped and named like `capacity.shapes()`."""
        return {name: flat[offset : offset + int(np.prod(shape))].reshape(shape)
                for name, (offset, shape) in self.fields.items()}


@dataclass
class _Captured:
    layout: StagingLayout
    graph: torch.cuda.CUDAGraph
    probabilities: torch.Tensor  # the graph's output [questions, labels]
    host_views: list[dict[str, np.ndarray]]  # per pinned staging buffer
    copies: list[tuple[torch.Tensor, torch.Tensor]]  # per staging buffer: (device, pinned) heads it copies


class Launch:
    """A round on its way through the device; `wait()` returns its probabilities [questions, labels]."""

    def __init__(self, probabilities: np.ndarray, events: Sequence[torch.cuda.Event], capacity: Capacity,
                 host_seconds: dict[str, float]) -> None:
        self._probabilities = probabilities
        self._events = events  # staged, copied in, replayed, read back
        self.capacity = capacity
        self.host_seconds = host_seconds  # host time of the launch's parts (`GraphRunner.launch`)

    def wait(self) -> np.ndarray:
        self._events[-1].synchronize()
        return self._probabilities

    def device_seconds(self) -> dict[str, float]:
        """GPU time of the copy in, the replay and the readback (call after `wait`)."""
        staged, copied, replayed, read = self._events
        return {
            "staging_seconds": staged.elapsed_time(copied) / 1000,
            "replay_seconds": copied.elapsed_time(replayed) / 1000,
            "readback_seconds": replayed.elapsed_time(read) / 1000,
        }


@dataclass(frozen=True)
class CaptureReport:
    graphs: int
    seconds: float
    memory_bytes: int


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
        self.rows, self.window_sink, self.kv_sink = rows, window_sink, kv_sink
        self.device = model.embed_tokens.weight.device
        layouts = [StagingLayout(capacity) for capacity in self.ladder]
        elements = max(layout.elements for layout in layouts)
        readback = max(c.questions * c.labels for c in self.ladder)
        self._device_buffer = torch.zeros(elements, dtype=torch.int64, device=self.device)
        self._staging = [torch.zeros(elements, dtype=torch.int64).pin_memory() for _ in range(BUFFERS)]
        self._readback = [torch.zeros(readback, dtype=torch.float32).pin_memory() for _ in range(BUFFERS)]
        self._copied: list[torch.cuda.Event | None] = [None] * BUFFERS
        # per buffer: staged, copied in, replayed, read back; reused by the round after next, which starts
        # only after this round's copy (`_copied`) and the engine's wait for it (its readback buffer too)
        self._events = [[torch.cuda.Event(enable_timing=True) for _ in range(4)] for _ in range(BUFFERS)]
        self._next = 0
        self._layouts = layouts
        self._captured: dict[Capacity, _Captured] = {}

    def capture(self) -> CaptureReport:
        """Capture one graph per capacity (largest first, one shared memory pool) on a placeholder round."""
        torch.cuda.synchronize(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        placeholder = plan_round(
            [RequestSpec(np.zeros(1, np.int64), Branches.of([np.zeros(1, np.int64)], [np.zeros(1, np.int64)]))],
            self.ladder[0].conv_kernel, self.rows, self.kv_sink,
        )
        for layout in reversed(self._layouts):
            capacity = layout.capacity
            LOG.debug("capturing the round graph of %d tokens", capacity.tokens)
            device_views = layout.views(self._device_buffer)
            staged = layout.views(self._staging[0].numpy())
            pad_into(placeholder, capacity, staged, self.window_sink, self.kv_sink, self.rows.zero)
            self._device_buffer[: layout.elements].copy_(self._staging[0][: layout.elements])
            rnd = placeholder.tensors(device_views)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self.model(rnd, self.ops, self.caches)  # warm-up: compiles kernels, sizes workspaces
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                probabilities = self.model(rnd, self.ops, self.caches)
            host_views = [layout.views(buffer.numpy()) for buffer in self._staging]
            copies = [(self._device_buffer[: layout.elements], buffer[: layout.elements]) for buffer in self._staging]
            self._captured[capacity] = _Captured(layout, graph, probabilities, host_views, copies)
        torch.cuda.synchronize(self.device)
        report = CaptureReport(len(self._captured), time.perf_counter() - started,
                               torch.cuda.memory_reserved(self.device) - reserved)
        LOG.info("captured %d CUDA graphs (%d to %d tokens) in %.1f s, %.2f GB", report.graphs,
                 self.ladder[0].tokens, self.ladder[-1].tokens, report.seconds, report.memory_bytes / 1e9)
        return report

    def launch(self, host: HostRound) -> Launch | None:
        """Stage, copy and replay `host` on the smallest graph it fits; None if it fits none (run it eagerly)."""
        capacity = choose(self.ladder, host)
        if capacity is None or capacity not in self._captured:
            return None
        captured = self._captured[capacity]
        buffer = self._next
        self._next = (self._next + 1) % BUFFERS
        started = time.perf_counter()
        if self._copied[buffer] is not None:
            self._copied[buffer].synchronize()  # the copy that last read this staging buffer is done
        freed = time.perf_counter()
        pad_into(host, capacity, captured.host_views[buffer], self.window_sink, self.kv_sink, self.rows.zero)
        padded = time.perf_counter()
        events = self._events[buffer]
        device_head, pinned_head = captured.copies[buffer]
        events[0].record()
        device_head.copy_(pinned_head, non_blocking=True)
        events[1].record()
        self._copied[buffer] = events[1]
        issued = time.perf_counter()
        captured.graph.replay()
        replayed = time.perf_counter()
        events[2].record()
        questions = host.num_questions
        out = self._readback[buffer][: questions * capacity.labels].view(questions, capacity.labels)
        out.copy_(captured.probabilities[:questions], non_blocking=True)
        events[3].record()
        host_seconds = {"buffer_wait_seconds": freed - started, "pad_seconds": padded - freed,
                        "copy_issue_seconds": issued - padded, "replay_call_seconds": replayed - issued}
        return Launch(out.numpy(), events, capacity, host_seconds)
