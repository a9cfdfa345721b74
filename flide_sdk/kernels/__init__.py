"""Compute kernels of flide_sdk.

`reference` holds the pure-torch definition of every op (the CPU path; it needs no Triton). Each other module
is one Triton kernel with its launch wrapper, tested against its reference; they are imported only on CUDA
(or under TRITON_INTERPRET=1 in tests). Kernels read only device tensors in the structs of `plans`, which the
round planner (`flide_sdk.plan`) fills, so their launch shapes depend on the stream capacity alone; the
package imports nothing else of flide_sdk. Why they are plain launches
and not programmatic dependent ones: docs/decisions/plain-kernel-launches.md.
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
