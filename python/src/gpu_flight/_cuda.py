"""The few CUDA driver calls an export needs, through NVIDIA's `cuda-bindings` package.

Finding the server's GPU among this process's (by UUID, then PCI bus id: ordinals depend on
`CUDA_VISIBLE_DEVICES`), opening and closing IPC handles, the event a consumer waits on, and
copies to the host. Calls run in each device's primary context, the one CuPy, PyTorch and cuDF
use, so pointers opened here are theirs to use. `cuda-bindings` is imported on first use: the
package works without it until an export is made.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional


class CudaError(RuntimeError):
    """A CUDA driver call failed; the message names the call and CUDA's error."""


@functools.cache
def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as error:
        raise ImportError(
            "exports map GPU memory through NVIDIA's CUDA driver bindings: install the "
            "'cuda-bindings' package (pip install 'gpu-flight[cuda]')"
        ) from error
    _check(driver, "cuInit", driver.cuInit(0))
    return driver


def _check(driver: Any, call: str, result: Any) -> Any:
    """The values after the CUresult in `result`, or CudaError naming `call`."""
    error, *values = result if isinstance(result, tuple) else (result,)
    if error != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(error)
        label = name.decode() if isinstance(name, bytes) else str(error)
        raise CudaError(f"{call} failed: {label}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def call(name: str, *args: Any) -> Any:
    """`cuda.bindings.driver.<name>(*args)`, checked."""
    driver = _driver()
    return _check(driver, name, getattr(driver, name)(*args))


def device_count() -> int:
    count: int = call("cuDeviceGetCount")
    return count


def uuid(ordinal: int) -> str:
    """Device `ordinal`'s UUID as nvidia-smi prints it ("GPU-…"): what the server knows it by."""
    raw = bytes(call("cuDeviceGetUuid", call("cuDeviceGet", ordinal)).bytes)
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def pci_bus_id(ordinal: int) -> str:
    raw = call("cuDeviceGetPCIBusId", 32, call("cuDeviceGet", ordinal))
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return text.split("\x00", 1)[0].lower()


_found: dict[tuple[str, str], Optional[int]] = {}


def find_device(device_uuid: str, bus_id: str) -> Optional[int]:
    """This process's ordinal of the GPU with this UUID (or, failing that, PCI bus id), or None
    if it cannot see it. Remembered: the visible devices do not change while a process runs."""
    key = (device_uuid, bus_id.lower())
    if key not in _found:
        ordinals = range(device_count())
        by_uuid = [o for o in ordinals if uuid(o) == device_uuid]
        by_bus = [o for o in ordinals if pci_bus_id(o) == bus_id.lower()]
        matches = by_uuid or by_bus
        _found[key] = matches[0] if matches else None
    return _found[key]


@functools.cache
def _primary_context(ordinal: int) -> Any:
    # Retained for the life of the process, as the CUDA runtime does.
    return call("cuDevicePrimaryCtxRetain", call("cuDeviceGet", ordinal))


@contextmanager
def on_device(ordinal: int) -> Iterator[None]:
    """Makes device `ordinal`'s primary context current for the block, then restores the
    caller's."""
    call("cuCtxPushCurrent", _primary_context(ordinal))
    try:
        yield
    finally:
        call("cuCtxPopCurrent")


class Mappings:
    """The IPC handles this process has open: each opened once per device however many
    exports use it (opening one twice in a process fails), closed with its last user."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[tuple[bytes, int], list[int]] = {}  # -> [pointer, users]

    def acquire(self, handle: bytes, ordinal: int) -> int:
        """The address `handle`'s allocation is mapped at on device `ordinal`."""
        with self._lock:
            entry = self._open.get((handle, ordinal))
            if entry is None:
                driver = _driver()
                raw = ctypes.create_string_buffer(handle, len(handle))
                ipc_handle = driver.CUipcMemHandle(_ptr=ctypes.addressof(raw))
                flags = driver.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
                with on_device(ordinal):
                    pointer = int(call("cuIpcOpenMemHandle", ipc_handle, flags))
                entry = self._open[(handle, ordinal)] = [pointer, 0]
            entry[1] += 1
            return entry[0]

    def release(self, handle: bytes, ordinal: int) -> None:
        with self._lock:
            entry = self._open[(handle, ordinal)]
            entry[1] -= 1
            if entry[1] == 0:
                del self._open[(handle, ordinal)]  # forgotten even if closing fails: not reusable
                with on_device(ordinal):
                    call("cuIpcCloseMemHandle", entry[0])

    def count(self) -> int:
        """How many handles are open (for tests)."""
        with self._lock:
            return len(self._open)


MAPPINGS = Mappings()


class Event:
    """A CUDA event recorded on device `ordinal`'s default stream (after the memory was
    mapped, when the first Arrow device array is handed out): their `sync_event`. The server
    commits data before it exports it, so the event completes at once; a consumer waiting on
    it is still correct if that ever changes to work queued here."""

    def __init__(self, ordinal: int) -> None:
        self.ordinal = ordinal
        driver = _driver()
        with on_device(ordinal):
            self._event = call("cuEventCreate", driver.CUevent_flags.CU_EVENT_DISABLE_TIMING)
            try:
                call("cuEventRecord", self._event, 0)
            except BaseException:
                call("cuEventDestroy", self._event)
                raise
        # The Arrow spec's sync_event for CUDA is a CUevent*: the address of the handle.
        self._slot = ctypes.c_void_p(int(self._event))

    @property
    def address(self) -> int:
        """Where the CUevent handle is stored: what `sync_event` points to."""
        return ctypes.addressof(self._slot)

    def destroy(self) -> None:
        with on_device(self.ordinal):
            call("cuEventDestroy", self._event)


def copy_to_host(pointer: int, nbytes: int, ordinal: int) -> bytes:
    """`nbytes` at device address `pointer` (mapped on `ordinal`), copied into host memory."""
    out = ctypes.create_string_buffer(max(nbytes, 1))
    if nbytes:
        with on_device(ordinal):
            call("cuMemcpyDtoH", ctypes.addressof(out), pointer, nbytes)
    return out.raw[:nbytes]
