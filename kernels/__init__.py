"""Compute kernels of flide_sdk, installed as `flide_sdk.kernels`.

One module per kernel. Each module holds the pure-torch reference (the definition, used on CPU and in
tests) and, once written, the Triton kernel with its autograd-free wrapper, proven against that
reference. Kernels read only device tensors planned on the host (`flide_sdk.layout`), so their launch
shapes depend on the stream capacity alone. The engine's kernels are launched as programmatic dependent
launches on Hopper (`dependent_launch`): a replay runs over 400 kernels, most of them short, and each
otherwise waits for the one before it to drain and flush before it is even scheduled.
"""

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl


class TileLaunch(NamedTuple):
    """One kernel part ready to launch, as its own launcher and a fused launch (`gdn_front`) use it: the
    arguments of its tile function before the block indices (its new outputs included), its constexprs, its
    grid of blocks, and the outputs it fills."""

    arguments: tuple
    constants: dict[str, int]
    grid: tuple[int, ...]
    outputs: tuple[torch.Tensor, ...]


PDL_MODES = {"off": 0, "wait": 1, "early": 2}
"""Programmatic dependent launch (Hopper and later) of the engine's kernels, by FLIDE_PDL (default "early"):
"off"; "wait": each kernel is launched so that it may start as soon as the kernel before it has exited
everywhere, and waits (griddepcontrol.wait) for that kernel's completion and memory before anything
else; "early": the same, and each kernel lets the next one launch as soon as it has passed its own wait, so
the next kernel's launch and block scheduling overlap this kernel's run."""


@functools.cache
def _pdl_mode(device: torch.device) -> int:
    mode = os.environ.get("FLIDE_PDL", "early")
    if mode not in PDL_MODES:
        raise ValueError(f"FLIDE_PDL={mode!r}: expected one of {', '.join(PDL_MODES)}")
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return 0
    return PDL_MODES[mode]


def dependent_launch(device: torch.device) -> dict:
    """The constexpr `PDL` and launch option of an engine kernel on `device` (`PDL_MODES`): every kernel that
    takes them starts with `wait_for_previous(PDL)`, before any load or store."""
    mode = _pdl_mode(device)
    return {"PDL": mode, "launch_pdl": True} if mode else {"PDL": 0}


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """A kernel's first statement: with PDL, wait for the kernel before it (all of its memory visible), then
    with PDL == 2 let the kernel after it launch. Every program runs it, so no kernel can end before the one
    it follows: the order of the stream holds transitively."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        if PDL == 2:
            tl.extra.cuda.gdc_launch_dependents()
