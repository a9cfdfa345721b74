"""Matrix products whose every output element is summed in one order whatever the number of rows: the GEMMs of
the batch-invariant mode.

cuBLAS picks its kernel by shape, and for few rows it splits K across blocks (split-K) or takes other tiles, so
a token's projection may change in its last bits with the round's size. `linear_triton` has one tile shape
(`MatmulConfig`, never chosen by the row count) and no split: each output element is one accumulator running
over K in BLOCK_K steps from 0. It is slower than cuBLAS, so `RowCountLinear` keeps cuBLAS for a weight shape
where it is shown, at load, to give every row the same bits at each row count a round can have (the graph
capacities), runs every other row count at one of those (padded up, or in chunks of the largest), and falls
back to `linear_triton` for a shape that fails. `F.linear` is the definition (`linear_reference`).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@dataclass(frozen=True)
class MatmulConfig:
    """The one tile shape: rows, columns and K per step, warps and pipeline stages; programs are ordered in
    groups of `group_rows` row tiles so the weight columns a group reads stay in L2."""

    block_rows: int = 128
    block_cols: int = 128
    block_k: int = 64
    warps: int = 8
    stages: int = 3
    group_rows: int = 8


MATMUL = MatmulConfig()
MATMUL_FLOAT32 = MatmulConfig(block_rows=32, block_cols=32, block_k=32, warps=4, stages=1)  # exact runs, tests


def linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T ([T, K] x [N, K] -> [T, N] in x's dtype): the definition."""
    return F.linear(x, weight)


@triton.jit
def _matmul_kernel(
    x_ptr, w_ptr, out_ptr, rows, cols, depth, stride_x, stride_w, stride_out,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr, IEEE: tl.constexpr,
):
    pid = tl.program_id(0)
    row_tiles = tl.cdiv(rows, BM)
    col_tiles = tl.cdiv(cols, BN)
    per_group = GROUP * col_tiles
    first = (pid // per_group) * GROUP
    size = tl.minimum(row_tiles - first, GROUP)
    row_tile = first + (pid % per_group) % size
    col_tile = (pid % per_group) // size
    r = (row_tile * BM + tl.arange(0, BM)).to(tl.int64)
    c = (col_tile * BN + tl.arange(0, BN)).to(tl.int64)
    k = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, depth, BK):
        k_ok = k0 + k < depth
        x = tl.load(x_ptr + r[:, None] * stride_x + (k0 + k)[None, :], mask=(r < rows)[:, None] & k_ok[None, :],
                    other=0.0)
        w = tl.load(w_ptr + c[:, None] * stride_w + (k0 + k)[None, :], mask=(c < cols)[:, None] & k_ok[None, :],
                    other=0.0)
        if IEEE:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    tl.store(out_ptr + r[:, None] * stride_out + c[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(r < rows)[:, None] & (c < cols)[None, :])


def linear_triton(x: torch.Tensor, weight: torch.Tensor, *, config: MatmulConfig | None = None) -> torch.Tensor:
    """`linear_reference`'s contract in one fixed summation order per element (x [T, K], weight [N, K] of one
    dtype, unit last strides; `config` None: the production tile of the dtype)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or x.dtype != weight.dtype:
        raise ValueError(f"linear: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    config = config or (MATMUL_FLOAT32 if x.dtype == torch.float32 else MATMUL)
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    rows, depth = x.shape
    cols = weight.shape[0]
    out = torch.empty(rows, cols, dtype=x.dtype, device=x.device)
    if rows and cols:
        grid = (triton.cdiv(rows, config.block_rows) * triton.cdiv(cols, config.block_cols),)
        _matmul_kernel[grid](
            x, weight, out, rows, cols, depth, x.stride(0), weight.stride(0), out.stride(0),
            BM=config.block_rows, BN=config.block_cols, BK=config.block_k, GROUP=config.group_rows,
            IEEE=x.dtype == torch.float32, num_warps=config.warps, num_stages=config.stages,
        )
    return out


MAX_FLOOR = 1024  # a shape whose cuBLAS sums agree only from more rows than this takes the fixed-tile kernel


@dataclass(frozen=True)
class RowCountLinear:
    """The batch-invariant mode's projection (`plan_linear`): for a weight shape in `floors`, cuBLAS at the row
    counts from its floor up (`row_counts`), any other count padded up to the next of them or cut into chunks
    of the largest; the fixed-tile kernel for any other shape."""

    row_counts: tuple[int, ...]  # sorted
    floors: dict[tuple[int, int], int]

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        floor = self.floors.get(tuple(weight.shape))
        if floor is None:
            return linear_triton(x, weight)
        rows = x.shape[0]
        counts = self.row_counts[bisect.bisect_left(self.row_counts, floor):]
        index = bisect.bisect_left(counts, rows)
        if index < len(counts) and counts[index] == rows:
            return F.linear(x, weight)
        step = counts[min(index, len(counts) - 1)]
        parts = []
        for start in range(0, rows, step):  # one part unless past the largest count
            part = x[start : start + step]
            padded = part.new_zeros(step, x.shape[1])
            padded[: part.shape[0]] = part
            parts.append(F.linear(padded, weight)[: part.shape[0]])
        return torch.cat(parts) if len(parts) != 1 else parts[0]


def plan_linear(shapes: Iterable[tuple[int, int]], row_counts: Iterable[int], device: torch.device,
                dtype: torch.dtype) -> RowCountLinear:
    """Each weight shape's floor ([N, K]): the fewest of `row_counts` from which, at every count up to the
    largest, random rows multiplied by cuBLAS have the bits they have among the most rows (cuBLAS picks its
    kernel by shape alone; one of another summation order would change some products' bits). Few rows are
    where it splits K; a shape whose floor passes MAX_FLOOR (or the largest count) is left out."""
    counts = tuple(sorted(set(row_counts)))
    generator = torch.Generator(device=device).manual_seed(0)
    floors = {}
    for n, k in sorted(set(shapes)):
        weight = torch.randn(n, k, generator=generator, device=device).to(dtype)
        x = torch.randn(counts[-1], k, generator=generator, device=device).to(dtype)
        full = F.linear(x, weight)
        floor = counts[-1]
        for m in reversed(counts[:-1]):
            if not torch.equal(F.linear(x[:m], weight), full[:m]):
                break
            floor = m
        if floor <= min(MAX_FLOOR, counts[-1]) and (floor < counts[-1] or len(counts) == 1):
            floors[(n, k)] = floor
    return RowCountLinear(counts, floors)
