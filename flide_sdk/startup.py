"""An engine's start-up: its stages timed, shown on stderr and logged, and the memory it holds.

`Engine.load` goes through weights -> kernels (a bundle, or compile on first use) -> serving; from then on
the round thread captures the CUDA-graph ladder in the background and reports each graph here. With
`progress` on (default: when stderr is a terminal) every stage prints one line and the capture a bar; the
same events go to the `flide_sdk` logger whatever `progress` says.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

import torch

from flide_sdk.kernels.bundle import InstallReport, current_key, load_bundle

LOG = logging.getLogger("flide_sdk")
BAR = 24  # characters of the capture bar


class Startup:
    """The clock and the display of one engine's start."""

    def __init__(self, progress: bool | None = None, stream: TextIO | None = None, label: str | None = None) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.prefix = "flide_sdk" if label is None else f"flide_sdk {label}"  # the lines of engines started at once
        terminal = bool(getattr(self.stream, "isatty", lambda: False)())
        self.show = terminal if progress is None else progress
        self.terminal = terminal
        self.started = time.perf_counter()
        self.stages: dict[str, float] = {}  # stage -> seconds from the start when it ended
        self._last = self.started

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def stage(self, name: str, detail: str = "") -> None:
        """A stage ended: print and log how long it took."""
        now = time.perf_counter()
        took, self._last = now - self._last, now
        self.stages[name] = now - self.started
        message = f"{name}: {took:.1f} s" + (f" ({detail})" if detail else "")
        LOG.info("start-up %s", message)
        if self.show:
            print(f"{self.prefix}: {message}", file=self.stream, flush=True)

    def graph_captured(self, captured: int, total: int, seconds: float, memory_bytes: int) -> None:
        """The round thread captured one more graph of `total` (`seconds`, `memory_bytes`: all so far)."""
        done = captured == total
        if done:
            LOG.info("captured %d CUDA graphs in %.1f s (%.2f GB); every capacity replays", total, seconds,
                     memory_bytes / 1e9)
        if not self.show or (not self.terminal and not done):
            return
        filled = BAR * captured // max(1, total)
        line = (f"{self.prefix}: CUDA graphs [{'#' * filled}{'.' * (BAR - filled)}] {captured}/{total} "
                f"{seconds:.1f} s {memory_bytes / 1e9:.2f} GB")
        print(("\r" if self.terminal else "") + line, end="\n" if done else "", file=self.stream, flush=True)


def memory_split(weights: int, graphs: int, pool_reserved: int, pool_used: int, pool_in_allocator: int,
                 device: torch.device) -> dict[str, int]:
    """Bytes of device memory by owner: weights, captured graphs, the checkpoint pool (reserved and used), and
    the work space (what torch's allocator holds beyond those: activations of eager rounds, buffers);
    `pool_in_allocator`: the pool's bytes that torch's allocator holds (none with CUDA virtual memory)."""
    held = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
    return {"weights_bytes": weights, "graph_memory_bytes": graphs, "pool_reserved_bytes": pool_reserved,
            "pool_used_bytes": pool_used,
            "workspace_bytes": max(0, held - weights - graphs - pool_in_allocator) if device.type == "cuda" else 0}


def size(bytes_: int) -> str:
    return f"{bytes_ / 1e9:.2f} GB" if bytes_ >= 1e9 else f"{bytes_ / 1e6:.1f} MB"


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def load_kernels(device: torch.device, startup: Startup) -> InstallReport | None:
    """Copy this machine's kernel bundle into Triton's cache (CUDA; nothing compiled yet), timed as a stage."""
    if device.type != "cuda":
        return None
    report = load_bundle(current_key(torch.cuda.get_device_capability(device)))
    startup.stage("kernels", "no bundle: compiled on first use" if report is None else
                  f"bundle {report.bundle.name}, {report.copied} files copied")
    return report
