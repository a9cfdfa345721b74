"""Engine options: the device and dtype to load on, the checkpoint pool's default budget, and the range of every
size option (refused before anything loads)."""

from __future__ import annotations

import contextlib

import torch

from flide_sdk.errors import DeviceError, InvalidOptionError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_POOL_BYTES = 512 << 20
CUDA_POOL_FRACTION = 0.4  # of the free device memory after the weights are loaded
MAX_PENDING = 4096  # queued asks before an ask waits for room (Engine.load's max_pending)
POOL_SESSIONS, POOL_SESSION_TOKENS = 64, 32768  # the default cap holds this many sessions of this many tokens


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device to load on: cuda when available, else cpu; DeviceError for another kind or an absent GPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as error:
        raise DeviceError(f"device {device!r} is not a device name: give 'cpu', 'cuda' or 'cuda:N'") from error
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            raise DeviceError(f"device {device!r}: {why} (torch {torch.__version__}); load on 'cpu'")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise DeviceError(f"device {device!r}: only {torch.cuda.device_count()} CUDA devices are visible")
    elif resolved.type != "cpu":
        raise DeviceError(f"device {device!r} is not supported: flide_sdk runs on 'cpu' or 'cuda'")
    return resolved


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Make `device` the calling thread's current CUDA device inside (the previous one comes back after): Triton
    launches, graph capture and replay, events and the driver's memory calls act on the current device, not on
    their tensors' (nothing on CPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise DeviceError(f"dtype must be one of {sorted(DTYPES)} (a name or the torch.dtype), got {dtype!r}")


def check_modes(device: torch.device, graphs: bool | None, batch_invariant: bool, custom_ops: bool,
                moe: bool = False, fp8: bool = False) -> None:
    """Refuse a combination of modes the engine cannot run: CUDA graphs off CUDA, or the batch-invariant mode
    with ops of the caller's (its guarantee rests on the engine's own fixed-order ops), on an MoE model (its
    routed experts have no fixed-order form) or with FP8 weights (no fixed-order FP8 GEMM)."""
    if batch_invariant and fp8:
        raise InvalidOptionError("batch_invariant=True is not available with FP8 weights: the scaled GEMM has no "
                                 "fixed-order form")
    if graphs and device.type != "cuda":
        raise DeviceError("CUDA graphs need a CUDA device (graphs=True on cpu)")
    if batch_invariant and custom_ops:
        raise InvalidOptionError("batch_invariant=True picks the engine's own fixed-order ops: give no `ops`")
    if batch_invariant and moe:
        raise InvalidOptionError("batch_invariant=True is not available for MoE models (qwen3_5_moe): their routed "
                                 "experts have no fixed-order kernels")


def check_fp8(device: torch.device, dtype: torch.dtype) -> None:
    """FP8 weights on CUDA need Hopper or newer (row-wise scaled FP8 GEMMs) and bfloat16 compute (their output)."""
    if device.type != "cuda":
        return
    if torch.cuda.get_device_capability(device) < (9, 0):
        name = torch.cuda.get_device_name(device)
        raise DeviceError(f"FP8 weights need a Hopper GPU or newer (compute capability 9.0); {device} is {name}")
    if dtype != torch.bfloat16:
        raise InvalidOptionError(f"FP8 weights on CUDA compute in bfloat16 (the scaled GEMM's output), got {dtype}")


def check_options(positions: int, **options: float | None) -> None:
    """Refuse an engine option out of range (None: its default). Sizes are positive integers (pool budgets may
    be 0: no checkpoints), the deadline a finite number of milliseconds, prompts within the model's positions."""
    for name, value in options.items():
        if value is None:
            continue
        if name == "round_deadline_ms":
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < float("inf")
            expected = "a finite number of milliseconds >= 0"
        else:
            low = 0 if name == "pool_bytes" else 1
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
            expected = f"an integer >= {low}"
        if not ok:
            raise InvalidOptionError(f"{name} must be {expected}, got {value!r}")
    if options.get("max_prompt_tokens") is not None and options["max_prompt_tokens"] > positions:
        raise InvalidOptionError(f"max_prompt_tokens={options['max_prompt_tokens']} is more than the model's "
                                 f"{positions} positions (max_position_embeddings)")


def default_pool_bytes(device: torch.device, session_bytes: int) -> int:
    """The checkpoint pool's default cap: the key/value pages of POOL_SESSIONS sessions of POOL_SESSION_TOKENS
    (`session_bytes` each) plus the quarter the pool gives its state slots, or CUDA_POOL_FRACTION of the free
    device memory (CPU: CPU_POOL_BYTES) if that is smaller. The pool holds memory only as it needs it."""
    sessions = POOL_SESSIONS * session_bytes * 4 // 3
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return min(sessions, int(free * CUDA_POOL_FRACTION))
    return min(sessions, CPU_POOL_BYTES)
