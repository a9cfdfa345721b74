"""Compute kernels of flide_sdk, installed as `flide_sdk.kernels`.

One module per kernel. Each module holds the pure-torch reference (the definition, used on CPU and in
tests) and, once written, the Triton kernel with its autograd-free wrapper, proven against that
reference. Kernels read only device tensors planned on the host (`flide_sdk.layout`), so their launch
shapes depend on the stream capacity alone. Launched as programmatic dependent launches (672d40f: every
kernel waiting for the one before it first thing, with and without letting the next launch at once), the
engine's graphs replayed no faster on the H200 and slower with the early trigger
(benchmarks/results/2026-12-01-pdl-ab-h200.json); so they are plain launches.
"""

import functools
from typing import NamedTuple

import torch


class TileLaunch(NamedTuple):
    """One kernel part ready to launch, as its own launcher and a fused launch (`gdn_front`) use it: the
    arguments of its tile function before the block indices (its new outputs included), its constexprs, its
    grid of blocks, and the outputs it fills."""

    arguments: tuple
    constants: dict[str, int]
    grid: tuple[int, ...]
    outputs: tuple[torch.Tensor, ...]


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The device's multiprocessor count (CUDA), or 4 (the interpreter on CPU runs programs one by one): what
    the kernels with capped grids size their programs by."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
