"""Arenas: tensors of a fixed address and shape whose memory is held only for the rows in use.

The checkpoint pool's state, window and key/value arrays are read by captured CUDA graphs, so they can never
move; yet the pool should take memory as its sessions need it and give it back when they are gone. An arena
holds rows [0, backed) plus the first `tail_held` rows of its tail (zero, scratch and sink rows), the rest of its
rows being address space only. On CUDA the memory is the driver's virtual memory (reserve the whole range once, map
physical memory into it as rows are backed, one extent a growth, and unmap an extent once none of its rows is
held; the first row stays mapped: Triton checks a tensor's address); rows are zeroed when they are backed. Where
that API is missing the arena allocates every row at once (`PlainArena`), as on CPU, where untouched host memory
is not resident.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

LOG = logging.getLogger(__name__)
CHUNK_BYTES = 2 << 20  # physical memory is mapped in chunks of this size (rounded to the driver's granularity)


class PlainArena:
    """Every row allocated up front; `backed` and `tail_held` are bookkeeping (host memory becomes resident as rows
    are used)."""

    def __init__(self, rows: int, row_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 tail_from: int, tail_held: int | None = None) -> None:
        self.rows, self.tail_from = rows, tail_from
        self.tail_held = rows - tail_from if tail_held is None else tail_held
        self.tensor = torch.empty(rows, *row_shape, dtype=dtype, device=device)
        self.row_bytes = self.tensor[0].numel() * self.tensor.element_size() if rows else 0
        self.tensor[tail_from : tail_from + self.tail_held].zero_()
        self.backed = 0

    def back(self, rows: int) -> None:
        """Hold rows [0, rows) (fewer: give the rest back); new rows read zero."""
        rows = min(rows, self.tail_from)
        if rows > self.backed:
            self.tensor[self.backed : rows].zero_()
        self.backed = rows

    def back_tail(self, rows: int) -> None:
        """Hold the tail's first `rows` rows (fewer: give the rest back); new rows read zero."""
        rows = min(rows, self.rows - self.tail_from)
        if rows > self.tail_held:
            self.tensor[self.tail_from + self.tail_held : self.tail_from + rows].zero_()
        self.tail_held = rows

    @property
    def reserved_bytes(self) -> int:
        """Device memory the arena holds (on CPU, the rows in use: the rest is not resident)."""
        held = self.backed + self.tail_held
        return (held if self.tensor.device.type == "cpu" else self.rows) * self.row_bytes

    def release(self) -> None:
        self.tensor = torch.zeros(0, device=self.tensor.device)
        self.rows = self.tail_from = self.tail_held = self.backed = 0


class _Prop(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location_type", ctypes.c_int),
                ("location_id", ctypes.c_int), ("win32HandleMetaData", ctypes.c_void_p),
                ("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _Access(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location_type", ctypes.c_int), ("location_id", ctypes.c_int), ("flags", ctypes.c_int)]


PINNED, ON_DEVICE, READ_WRITE, RECOMMENDED = 1, 1, 3, 1  # CUDA driver enum values
OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY


class DeviceMemoryFull(RuntimeError):
    """The device has no physical memory left for an arena to grow into (its rows stay as they were)."""


class _Driver:
    """The few CUDA driver calls of virtual memory management, through ctypes."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")

    def __call__(self, name: str, *args) -> None:
        status = getattr(self.lib, name)(*args)
        if status == OUT_OF_MEMORY:
            raise DeviceMemoryFull(f"{name}: the device is out of memory")
        if status != 0:
            raise RuntimeError(f"{name} failed with CUDA driver error {status}")


class _DeviceMemory:
    """`__cuda_array_interface__` of a raw range, for `torch.as_tensor` (zero-copy)."""

    def __init__(self, address: int, size: int) -> None:
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (address, False), "version": 3}


class VirtualArena:
    """Rows in one reserved range of device addresses, physical memory mapped chunk by chunk."""

    def __init__(self, rows: int, row_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 tail_from: int, tail_held: int | None = None) -> None:
        self.driver = _Driver()
        device = torch.device(device.type, torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)  # the driver calls need the device's primary context current
        self.device, self.rows, self.tail_from = device, rows, tail_from
        self.row_bytes = torch.Size(row_shape).numel() * torch.empty(0, dtype=dtype).element_size()
        self.prop = _Prop(type=PINNED, location_type=ON_DEVICE, location_id=device.index or 0)
        self.access = _Access(location_type=ON_DEVICE, location_id=device.index or 0, flags=READ_WRITE)
        granularity = ctypes.c_size_t()
        self.driver("cuMemGetAllocationGranularity", ctypes.byref(granularity), ctypes.byref(self.prop), RECOMMENDED)
        self.chunk = -(-CHUNK_BYTES // granularity.value) * granularity.value
        self.size = max(1, -(-rows * self.row_bytes // self.chunk)) * self.chunk
        address = ctypes.c_uint64()
        self.driver("cuMemAddressReserve", ctypes.byref(address), ctypes.c_size_t(self.size),
                    ctypes.c_size_t(self.chunk), ctypes.c_uint64(0), ctypes.c_uint64(0))
        self.address = address.value
        # the mapped extents: first chunk -> (chunks, their one physical allocation); a growth maps one extent,
        # so backing a gigabyte takes three driver calls, not three per chunk
        self.extents: dict[int, tuple[int, int]] = {}
        # and the first row: the address of a view of it (a layer's states) must be mapped memory for Triton to
        # take it as a device pointer
        self.tail_held = rows - tail_from if tail_held is None else tail_held
        self.tail = self._tail_chunks(self.tail_held)
        self._map(self.tail)
        raw = torch.as_tensor(_DeviceMemory(self.address, self.size), device=device)
        self.tensor = raw[: rows * self.row_bytes].view(dtype).view(rows, *row_shape)
        self.tensor[tail_from : tail_from + self.tail_held].zero_()
        self.backed = 0

    def _tail_chunks(self, held: int) -> set[int]:
        """Chunks always mapped with `held` tail rows held: theirs and the first row's."""
        return set(self._chunks(self.tail_from, self.tail_from + held)) | set(self._chunks(0, 1))

    def _chunks(self, start: int, stop: int) -> range:
        """Chunks holding bytes of rows [start, stop)."""
        if stop <= start:
            return range(0)
        return range(start * self.row_bytes // self.chunk, -(-stop * self.row_bytes // self.chunk))

    def _mapped(self) -> set[int]:
        return {first + i for first, (count, _) in self.extents.items() for i in range(count)}

    def _map(self, chunks) -> None:
        """Map the chunks not mapped yet, each run of consecutive ones as one extent."""
        missing = sorted(set(chunks) - self._mapped())
        runs = [[index] for index in missing[:1]]
        for index in missing[1:]:
            if index == runs[-1][-1] + 1:
                runs[-1].append(index)
            else:
                runs.append([index])
        for run in runs:
            size = ctypes.c_size_t(len(run) * self.chunk)
            handle = ctypes.c_uint64()
            self.driver("cuMemCreate", ctypes.byref(handle), size, ctypes.byref(self.prop), ctypes.c_uint64(0))
            at = ctypes.c_uint64(self.address + run[0] * self.chunk)
            try:
                self.driver("cuMemMap", at, size, ctypes.c_size_t(0), handle, ctypes.c_uint64(0))
                self.driver("cuMemSetAccess", at, size, ctypes.byref(self.access), ctypes.c_size_t(1))
            except RuntimeError:
                self.driver("cuMemRelease", handle)
                raise
            self.extents[run[0]] = (len(run), handle.value)

    def _unmap(self, chunks) -> None:
        """Unmap the extents all of whose chunks are among `chunks` (an extent partly in use stays)."""
        chunks = set(chunks)
        for first, (count, handle) in sorted(self.extents.items()):
            if all(first + i in chunks for i in range(count)):
                self.driver("cuMemUnmap", ctypes.c_uint64(self.address + first * self.chunk),
                            ctypes.c_size_t(count * self.chunk))
                self.driver("cuMemRelease", ctypes.c_uint64(handle))
                del self.extents[first]

    def back(self, rows: int) -> None:
        """Hold rows [0, rows) (fewer: unmap the extents no held row uses; call it with the device idle)."""
        rows = min(rows, self.tail_from)
        if rows > self.backed:
            self._map(self._chunks(self.backed, rows))
            self.tensor[self.backed : rows].zero_()
        elif rows < self.backed:
            torch.cuda.synchronize(self.device)
            self._unmap(self._mapped() - set(self._chunks(0, rows)) - self.tail)
        self.backed = rows

    def back_tail(self, rows: int) -> None:
        """Hold the tail's first `rows` rows (fewer: unmap what no held row uses; call it with the device idle)."""
        rows = min(rows, self.rows - self.tail_from)
        tail = self._tail_chunks(rows)
        if rows > self.tail_held:
            self._map(tail)
            self.tensor[self.tail_from + self.tail_held : self.tail_from + rows].zero_()
        elif rows < self.tail_held:
            torch.cuda.synchronize(self.device)
            self._unmap(self._mapped() - set(self._chunks(0, self.backed)) - tail)
        self.tail, self.tail_held = tail, rows

    @property
    def reserved_bytes(self) -> int:
        return sum(count for count, _ in self.extents.values()) * self.chunk

    def release(self) -> None:
        """Unmap everything and free the address range (once: a second call does nothing)."""
        if self.address is None:
            return
        torch.cuda.synchronize(self.device)
        self.tensor = torch.zeros(0, device=self.device)
        self._unmap(self._mapped())
        self.driver("cuMemAddressFree", ctypes.c_uint64(self.address), ctypes.c_size_t(self.size))
        self.address, self.backed = None, 0


Arena = PlainArena | VirtualArena


@functools.cache
def holds_on_demand(device: torch.device) -> bool:
    """Whether arenas on `device` hold memory only for the rows in use: on CPU (untouched host memory is not
    resident) and on CUDA with the driver's virtual memory (tried once per device)."""
    if device.type != "cuda":
        return True
    try:
        VirtualArena(1, (1,), torch.uint8, device, 1).release()
    except (OSError, AttributeError, RuntimeError, ValueError) as error:
        LOG.warning("CUDA virtual memory unavailable (%s): the checkpoint pool allocates its cap at once", error)
        return False
    return True


def arena(rows: int, row_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
          tail_from: int, tail_held: int | None = None) -> Arena:
    """An arena of `rows` rows, the tail rows [tail_from, rows) held as `back_tail` says (at first `tail_held`,
    default all): virtual memory on CUDA, else plain."""
    if device.type == "cuda" and holds_on_demand(device):
        try:
            return VirtualArena(rows, row_shape, dtype, device, tail_from, tail_held)
        except (OSError, AttributeError, RuntimeError, ValueError) as error:
            LOG.warning("CUDA virtual memory unavailable (%s): the checkpoint pool allocates its cap at once", error)
    return PlainArena(rows, row_shape, dtype, device, tail_from, tail_held)
