"""The Gated DeltaNet's work before its recurrence, in one launch: the indexed short convolution (+SiLU) of
q|k|v, the gates (decay g, write rate beta), and the conv windows the round saves for its checkpoints.

All three read the fused input projection (the conv and the saves also the pool's window arena, at the
resumed slots only; the saves write other slots, `short_conv`) and write disjoint outputs, so one grid runs
them side by side: programs [0, G) compute the gates of G token blocks, the next S copy saved windows, the
rest are the conv's tiles. Separately they were three launches per layer, the gates and the saves a few
microseconds each of mostly launch latency. The tiles are the kernels' own (`_gates_tile`, `_save_window`,
`_conv_tile`), so each part computes exactly what its own kernel computes. `gdn_front_reference` is the
definition (the three references); `gdn_front_triton` the launch (grid from tensor shapes only: CUDA-graph
safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flide_sdk.kernels.gdn_gates import _gates_tile, gates_launch
from flide_sdk.kernels.short_conv import (
    _conv_tile,
    _save_window,
    conv_launch,
    save_launch,
)


@triton.jit
def _gdn_front_kernel(
    x_ptr, window_base, resume_ptr, weight_ptr, src_ptr, out_ptr, total, channels,
    stride_x, stride_cs, stride_ck, stride_weight, stride_tap, stride_src, stride_out,
    a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, tokens, heads, stride_a, stride_b,
    save_x_ptr, save_cache_ptr, save_window_base, save_resume_ptr, save_slots_ptr, save_src_ptr, save_total,
    save_channels,
    save_stride_x, save_stride_cs, save_stride_ck, stride_save_src,
    gate_programs, save_programs, channel_blocks, save_channel_blocks,
    TAPS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, EVEN_C: tl.constexpr, GATE_BT: tl.constexpr,
    BH: tl.constexpr, WINDOW: tl.constexpr, BW: tl.constexpr, SAVE_BC: tl.constexpr,
):
    job = tl.program_id(0)
    if job < gate_programs:
        _gates_tile(a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, tokens, heads, stride_a, stride_b,
                    job, GATE_BT, BH)
    elif job < gate_programs + save_programs:
        job -= gate_programs
        _save_window(save_x_ptr, save_cache_ptr, save_window_base, save_resume_ptr, save_slots_ptr, save_src_ptr,
                     save_total, save_channels, save_stride_x, save_stride_cs, save_stride_ck, stride_save_src,
                     job // save_channel_blocks, job % save_channel_blocks, WINDOW, BW, SAVE_BC)
    else:
        job -= gate_programs + save_programs
        _conv_tile(x_ptr, window_base, resume_ptr, weight_ptr, src_ptr, out_ptr, total, channels,
                   stride_x, stride_cs, stride_ck, stride_weight, stride_tap, stride_src, stride_out,
                   job // channel_blocks, job % channel_blocks, TAPS, BT, BC, EVEN_C)


def gdn_front_triton(
    qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor,
    dt_bias: torch.Tensor, window_cache: torch.Tensor, resume_slots: torch.Tensor, conv_src: torch.Tensor,
    save_slots: torch.Tensor, save_src: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One launch behind the contract of `gdn_front_reference` (the conv's sum in float32)."""
    conv = conv_launch(qkv, window_cache, resume_slots, conv_weight, conv_src)
    gates = gates_launch(a, b, A_log, dt_bias)
    save = save_launch(qkv, window_cache, resume_slots, save_slots, save_src)
    (gate_programs,), (token_blocks, channel_blocks), (saves, save_channel_blocks) = gates.grid, conv.grid, save.grid
    save_programs = saves * save_channel_blocks
    programs = gate_programs + save_programs + token_blocks * channel_blocks
    if programs:
        _gdn_front_kernel[(programs,)](
            *conv.arguments, *gates.arguments, *save.arguments,
            gate_programs, save_programs, channel_blocks, save_channel_blocks,
            **conv.constants, GATE_BT=gates.constants["BT"], BH=gates.constants["BH"],
            WINDOW=save.constants["WINDOW"], BW=save.constants["BW"], SAVE_BC=save.constants["BC"],
        )
    return conv.outputs[0], *gates.outputs
