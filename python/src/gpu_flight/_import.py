"""Producer-side zero copy: columns this process holds on a GPU handed to the server without
the network (`Client.put_device`, the server's `ipc-import` action).

The server copies them device to device into memory of its own and commits them as a put of
them would (atomic, paid for first, `create`, `replace` or `append`), so the memory here may
be freed as soon as the call returns. It needs the server on this node, on the GPU the
columns are on, and memory that can be shared: every buffer's allocation is found with
`cuMemGetAddressRange` and named by its CUDA IPC handle, which memory from a stream-ordered
pool (`cudaMallocAsync`) does not have.

What can be handed over: anything with `__arrow_c_device_array__` (a record batch on a CUDA
device: pylibcudf, nanoarrow, CUDA-enabled pyarrow) or `__arrow_c_device_stream__` (each batch
in turn: the first with `mode`, the rest appended, so a stream of several batches is not one
atomic put), a cuDF DataFrame (through the Arrow device interface), or a dict of equally long
one-dimensional CuPy arrays or PyTorch tensors (`__cuda_array_interface__`; no nulls).
"""

from __future__ import annotations

import base64
import ctypes
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import pyarrow as pa

from . import _cdata, _cuda
from ._actions import Actions
from ._documents import PutResult

IMPORT_VERSION = 1

Allocation = tuple[bytes, int, int]
"""An allocation's IPC handle (64 bytes), base address and size."""


class NotShareable(RuntimeError):
    """Device memory that cannot be handed to another process."""


# The Arrow type of a CUDA array interface's `typestr` kind and item size.
_ARRAY_INTERFACE_TYPES: dict[str, dict[int, pa.DataType]] = {
    "i": {1: pa.int8(), 2: pa.int16(), 4: pa.int32(), 8: pa.int64()},
    "u": {1: pa.uint8(), 2: pa.uint16(), 4: pa.uint32(), 8: pa.uint64()},
    "f": {2: pa.float16(), 4: pa.float32(), 8: pa.float64()},
}


def allocation_of(pointer: int, ordinal: int) -> Allocation:
    """The allocation holding device address `pointer` on device `ordinal`: its IPC handle,
    base and size."""
    with _cuda.on_device(ordinal):
        base, size = _cuda.call("cuMemGetAddressRange", pointer)
        try:
            handle = _cuda.call("cuIpcGetMemHandle", base)
        except _cuda.CudaError as error:
            raise NotShareable(
                f"{error}: this memory cannot be shared with the server's process. Memory from a "
                "stream-ordered pool (cudaMallocAsync: CuPy's MemoryAsyncPool, PyTorch with "
                "PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync, RMM's CudaAsyncMemoryResource) "
                "has no IPC handle; allocate with cudaMalloc (the default of CuPy, PyTorch and RMM)"
            ) from error
    return _handle_bytes(handle), int(base), int(size)


def _handle_bytes(handle: Any) -> bytes:
    """The 64 bytes of a cuda-bindings `CUipcMemHandle`."""
    if hasattr(handle, "getPtr"):
        return ctypes.string_at(int(handle.getPtr()), 64)
    reserved = handle.reserved
    if isinstance(reserved, (bytes, bytearray)):
        return bytes(reserved[:64])
    return bytes(int(x) & 0xFF for x in reserved)[:64]


def _read_offset(pointer: int, index: int, width: int, ordinal: int) -> int:
    data = _cuda.copy_to_host(pointer + index * width, width, ordinal)
    return int.from_bytes(data, "little", signed=True)


@dataclass
class _Document:
    """An import document being built: each buffer found in its allocation."""

    ordinal: int
    find: Callable[[int, int], Allocation]
    read_offset: Callable[[int, int, int, int], int]
    cache: list[Allocation] = field(default_factory=list)

    def allocation(self, pointer: int) -> Allocation:
        for known in self.cache:
            if known[1] <= pointer < known[1] + known[2]:
                return known
        found = self.find(pointer, self.ordinal)
        self.cache.append(found)
        return found

    def buffer(self, kind: str, pointer: int, length: int, own: list[Optional[Allocation]]) -> dict[str, Any]:
        """A buffer of the document; `own` holds the column's allocation (the first found)."""
        if length == 0 or not pointer:
            return {"kind": kind, "offset": 0, "length": 0}
        allocation = self.allocation(pointer)
        first = own[0]
        if first is None:
            first = own[0] = allocation
        out: dict[str, Any] = {"kind": kind, "offset": pointer - allocation[1], "length": length}
        if allocation[0] != first[0]:
            out["handle"] = base64.b64encode(allocation[0]).decode()
            out["allocation_bytes"] = allocation[2]
        return out

    def array(
        self,
        data_type: pa.DataType,
        struct: _cdata.ArrowArray,
        length: int,
        offset: int,
        own: list[Optional[Allocation]],
    ) -> dict[str, Any]:
        """The document of `length` rows from row `offset` of the C array `struct`."""
        data_type = _cdata.storage(data_type)
        kinds = _cdata.buffer_kinds(data_type)
        pointers = [struct.buffers[i] or 0 for i in range(struct.n_buffers)]
        if len(pointers) != len(kinds) and not (pa.types.is_null(data_type) and not pointers):
            raise ValueError(f"a {data_type} array has {len(kinds)} buffers, not {len(pointers)}")
        buffers: list[dict[str, Any]] = []
        children: list[dict[str, Any]] = []
        dictionary = None
        # The server counts a bitmap's nulls itself; a count the producer does not know is -1.
        null_count = min(max(int(struct.null_count), 0), length)

        def bits(pointer: int, what: str) -> tuple[int, int]:
            if offset % 8:
                raise NotImplementedError(
                    f"a {data_type} array whose {what} starts mid-byte (a slice at row {offset}): "
                    "hand over a copy"
                )
            return pointer + offset // 8, (length + 7) // 8

        if pointers and pointers[0] and length:
            start, nbytes = bits(pointers[0], "validity bitmap")
            buffers.append(self.buffer("validity", start, nbytes, own))
        else:
            null_count = 0
        child_types = _cdata.child_types(data_type)
        if pa.types.is_null(data_type):
            pass
        elif pa.types.is_boolean(data_type):
            start, nbytes = bits(pointers[1], "values")
            buffers.append(self.buffer("values", start, nbytes, own))
        elif kinds == ["validity", "offsets", "values"] or kinds == ["validity", "offsets"]:
            width = (
                8
                if (
                    pa.types.is_large_string(data_type)
                    or pa.types.is_large_binary(data_type)
                    or pa.types.is_large_list(data_type)
                )
                else 4
            )
            first = self.read_offset(pointers[1], offset, width, self.ordinal)
            last = self.read_offset(pointers[1], offset + length, width, self.ordinal)
            if first != 0:
                raise NotImplementedError(
                    f"a {data_type} array whose offsets start at {first}, not 0 (a slice): hand over a copy"
                )
            buffers.append(self.buffer("offsets", pointers[1] + offset * width, (length + 1) * width, own))
            if len(kinds) == 3:
                buffers.append(self.buffer("values", pointers[2], last, own))
            else:
                child = struct.children[0].contents
                children.append(self.array(child_types[0], child, last, child.offset, own))
        elif pa.types.is_struct(data_type):
            for i, child_type in enumerate(child_types):
                child = struct.children[i].contents
                children.append(self.array(child_type, child, length, child.offset + offset, own))
        elif pa.types.is_fixed_size_list(data_type):
            size = data_type.list_size
            child = struct.children[0].contents
            children.append(
                self.array(child_types[0], child, length * size, child.offset + offset * size, own)
            )
        elif pa.types.is_dictionary(data_type):
            width = data_type.index_type.bit_width // 8
            buffers.append(self.buffer("values", pointers[1] + offset * width, length * width, own))
            values = struct.dictionary.contents
            dictionary = self.array(data_type.value_type, values, int(values.length), int(values.offset), own)
        else:
            width = data_type.bit_width // 8
            buffers.append(self.buffer("values", pointers[1] + offset * width, length * width, own))
        out: dict[str, Any] = {
            "length": length,
            "null_count": null_count,
            "buffers": buffers,
            "children": children,
        }
        if dictionary is not None:
            out["dictionary"] = dictionary
        return out


def import_document(
    name: str,
    mode: str,
    schema: pa.Schema,
    batch: _cdata.ArrowArray,
    ordinal: int,
    device: dict[str, Any],
    find: Callable[[int, int], Allocation] = allocation_of,
    read_offset: Callable[[int, int, int, int], int] = _read_offset,
) -> dict[str, Any]:
    """The `ipc-import` document of `batch` (a struct array of `schema`'s fields, as the C
    device interface gives a record batch) on device `ordinal`, named `device` for the
    server. `find` and `read_offset` reach the device (tests pass their own)."""
    builder = _Document(ordinal, find, read_offset)
    rows = int(batch.length)
    columns = []
    for index, column_field in enumerate(schema):
        child = batch.children[index].contents
        own: list[Optional[Allocation]] = [None]
        array = builder.array(column_field.type, child, rows, int(child.offset) + int(batch.offset), own)
        handle, size = (own[0][0], own[0][2]) if own[0] is not None else (bytes(64), 0)
        columns.append({"handle": base64.b64encode(handle).decode(), "allocation_bytes": size, **array})
    return {
        "version": IMPORT_VERSION,
        "name": name,
        "mode": mode,
        "device": device,
        "num_rows": rows,
        "schema": base64.b64encode(schema.serialize().to_pybytes()).decode(),
        "columns": columns,
    }


def _device(ordinal: int) -> dict[str, Any]:
    return {"ordinal": ordinal, "uuid": _cuda.uuid(ordinal), "pci_bus_id": _cuda.pci_bus_id(ordinal)}


def _wait(device_array: _cdata.ArrowDeviceArray) -> None:
    """Waits for the producer's work on the arrays: their sync event, then the device."""
    ordinal = int(device_array.device_id)
    with _cuda.on_device(ordinal):
        if device_array.sync_event:
            event = ctypes.c_void_p.from_address(device_array.sync_event).value
            if event:
                _cuda.call("cuEventSynchronize", event)
        _cuda.call("cuCtxSynchronize")


def _import_batch(
    client: Actions, name: str, mode: str, schema: pa.Schema, device_array: _cdata.ArrowDeviceArray
) -> PutResult:
    if device_array.device_type != _cdata.ARROW_DEVICE_CUDA:
        raise ValueError(
            f"put_device takes data on a CUDA device (Arrow device type {_cdata.ARROW_DEVICE_CUDA}), "
            f"not device type {device_array.device_type}: use put for host memory"
        )
    ordinal = int(device_array.device_id)
    _wait(device_array)
    document = import_document(name, mode, schema, device_array.array, ordinal, _device(ordinal))
    return PutResult.from_json(client._action("ipc-import", document))


def _release(struct: Any) -> None:
    if struct.release:
        struct.release(ctypes.pointer(struct))


def _from_device_array(client: Actions, name: str, mode: str, obj: Any) -> PutResult:
    schema_capsule, array_capsule = obj.__arrow_c_device_array__()
    schema = pa.Schema._import_from_c_capsule(schema_capsule)
    pointer = _cdata.capsule_pointer(array_capsule, _cdata.DEVICE_ARRAY)
    device_array = _cdata.ArrowDeviceArray.from_address(pointer)
    try:
        return _import_batch(client, name, mode, schema, device_array)
    finally:
        _release(device_array.array)  # the capsule is ours: its release is then a no-op


def _from_device_stream(client: Actions, name: str, mode: str, obj: Any) -> PutResult:
    capsule = obj.__arrow_c_device_stream__()
    pointer = _cdata.capsule_pointer(capsule, _cdata.DEVICE_STREAM)
    stream = _cdata.ArrowDeviceArrayStream.from_address(pointer)
    raw_schema = ctypes.create_string_buffer(72)  # an ArrowSchema
    if stream.get_schema(ctypes.pointer(stream), ctypes.addressof(raw_schema)):
        raise RuntimeError("the device stream gave no schema")
    schema = pa.Schema._import_from_c(ctypes.addressof(raw_schema))
    result: Optional[PutResult] = None
    while True:
        device_array = _cdata.ArrowDeviceArray()
        if stream.get_next(ctypes.pointer(stream), ctypes.pointer(device_array)):
            raise RuntimeError("the device stream failed to give its next batch")
        if not device_array.array.release:
            break
        try:
            result = _import_batch(client, name, mode if result is None else "append", schema, device_array)
        finally:
            _release(device_array.array)
    if result is None:
        raise ValueError("the device stream held no batch")
    return result


def _columns(obj: Mapping[str, Any]) -> tuple[pa.Schema, _cdata.ArrowDeviceArray, list[Any]]:
    """A dict of one-dimensional CUDA arrays (CuPy, PyTorch) as a record batch in the C device
    interface, and what it points into."""
    fields = []
    arrays = []
    ordinals = set()
    rows: Optional[int] = None
    for column_name, column in obj.items():
        if not hasattr(column, "__cuda_array_interface__") and hasattr(column, "__dlpack__"):
            raise TypeError(f"column {column_name!r}: pass CUDA arrays with __cuda_array_interface__")
        interface = column.__cuda_array_interface__
        shape = tuple(interface["shape"])
        if len(shape) != 1:
            raise ValueError(f"column {column_name!r} has shape {shape}: columns are one-dimensional")
        typestr = interface["typestr"]
        itemsize = int(typestr[2:])
        strides = interface.get("strides")
        if strides not in (None, (itemsize,)):
            raise ValueError(f"column {column_name!r} is not contiguous: hand over a copy")
        if interface.get("mask") is not None:
            raise NotImplementedError(f"column {column_name!r} has a mask: use Arrow arrays for nulls")
        kind = typestr[1]
        if kind == "b":
            raise NotImplementedError(
                f"column {column_name!r} holds booleans a byte each; Arrow packs them in bits: "
                "convert to uint8, or hand over an Arrow array"
            )
        data_type = _ARRAY_INTERFACE_TYPES.get(kind, {}).get(itemsize)
        if data_type is None or typestr[0] == ">":
            raise TypeError(f"column {column_name!r} has the unsupported type {typestr}")
        if rows is None:
            rows = shape[0]
        elif rows != shape[0]:
            raise ValueError(f"column {column_name!r} has {shape[0]} rows, not {rows}")
        pointer = int(interface["data"][0])
        if pointer:
            with _cuda.on_device(0):
                ordinals.add(int(_cuda.call("cuPointerGetAttribute", _pointer_ordinal(), pointer)))
        fields.append(pa.field(column_name, data_type, nullable=False))
        arrays.append((pointer, shape[0]))
    if len(ordinals) > 1:
        raise ValueError(f"the columns are on several GPUs ({sorted(ordinals)}): hand over each GPU's apart")
    keep: list[Any] = []
    children = []
    for pointer, length in arrays:
        child = _cdata.ArrowArray()
        buffers = (ctypes.c_void_p * 2)(None, pointer or None)
        keep.append(buffers)
        child.length, child.null_count, child.offset = length, 0, 0
        child.n_buffers, child.n_children = 2, 0
        child.buffers = buffers
        children.append(child)
    keep.extend(children)
    child_pointers = (ctypes.POINTER(_cdata.ArrowArray) * max(1, len(children)))(
        *[ctypes.pointer(child) for child in children]
    )
    keep.append(child_pointers)
    device_array = _cdata.ArrowDeviceArray()
    device_array.array.length = rows or 0
    device_array.array.n_buffers = 1
    device_array.array.n_children = len(children)
    device_array.array.children = child_pointers
    device_array.device_type = _cdata.ARROW_DEVICE_CUDA
    device_array.device_id = ordinals.pop() if ordinals else 0
    return pa.schema(fields), device_array, keep


def _pointer_ordinal() -> Any:
    return _cuda._driver().CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL


def _is_cudf_frame(obj: Any) -> bool:
    return type(obj).__module__.startswith("cudf") and hasattr(obj, "columns")


def put_device(client: Actions, name: str, obj: Any, mode: str) -> PutResult:
    """`Client.put_device`: see there."""
    if _is_cudf_frame(obj) and not hasattr(obj, "__arrow_c_device_array__"):
        # Older cuDF without the Arrow device interface: its numeric columns as CuPy arrays.
        obj = {str(column): obj[column].values for column in obj.columns}
    if hasattr(obj, "__arrow_c_device_array__"):
        return _from_device_array(client, name, mode, obj)
    if hasattr(obj, "__arrow_c_device_stream__"):
        return _from_device_stream(client, name, mode, obj)
    if isinstance(obj, Mapping):
        schema, device_array, keep = _columns(obj)
        result = _import_batch(client, name, mode, schema, device_array)
        del keep
        return result
    raise TypeError(
        f"put_device takes an object with __arrow_c_device_array__ or __arrow_c_device_stream__ "
        f"(cuDF, pylibcudf, nanoarrow, pyarrow on CUDA) or a dict of CuPy arrays or PyTorch "
        f"tensors, not {type(obj).__name__}"
    )
