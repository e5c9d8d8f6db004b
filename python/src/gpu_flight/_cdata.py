"""The Arrow C device data interface and DLPack, produced over memory this package does not own.

An export's columns are pointers into CUDA allocations another process (the server) owns and
this one has mapped. This module describes them to consumers without copying: as Arrow
`ArrowDeviceArray` trees and `ArrowDeviceArrayStream`s in the PyCapsules of the Arrow PyCapsule
interface (`arrow_device_array`, `arrow_device_array_stream`, with `arrow_schema` from
pyarrow), and as DLPack `DLManagedTensor`s (`dltensor`). The structs are the specifications'
ABI (arrow/c/abi.h, dlpack.h), declared with ctypes so the package stays pure Python.

Whatever a consumer holds keeps the memory mapped: every struct handed out takes a `Pin` on its
owner and gives it back when the consumer calls `release` (Arrow) or `deleter` (DLPack), or when
a capsule nobody consumed is collected. Children a consumer moves out are released on their own,
as the Arrow specification allows.
"""

from __future__ import annotations

import ctypes
import itertools
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import pyarrow as pa

ARROW_DEVICE_CPU = 1
ARROW_DEVICE_CUDA = 2
DLPACK_CPU = 1
DLPACK_CUDA = 2


class Pin(Protocol):
    """What keeps the memory behind a handed-out struct valid: taken once per struct."""

    def acquire(self) -> None: ...

    def release(self) -> None: ...


# The specifications' structs.


class ArrowArray(ctypes.Structure):
    pass


ReleaseArray = ctypes.CFUNCTYPE(None, ctypes.POINTER(ArrowArray))
ArrowArray._fields_ = [
    ("length", ctypes.c_int64),
    ("null_count", ctypes.c_int64),
    ("offset", ctypes.c_int64),
    ("n_buffers", ctypes.c_int64),
    ("n_children", ctypes.c_int64),
    ("buffers", ctypes.POINTER(ctypes.c_void_p)),
    ("children", ctypes.POINTER(ctypes.POINTER(ArrowArray))),
    ("dictionary", ctypes.POINTER(ArrowArray)),
    ("release", ReleaseArray),
    ("private_data", ctypes.c_void_p),
]


class ArrowDeviceArray(ctypes.Structure):
    _fields_ = [
        ("array", ArrowArray),
        ("device_id", ctypes.c_int64),
        ("device_type", ctypes.c_int32),
        ("sync_event", ctypes.c_void_p),
        ("reserved", ctypes.c_int64 * 3),
    ]


class ArrowDeviceArrayStream(ctypes.Structure):
    pass


GetSchema = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ArrowDeviceArrayStream), ctypes.c_void_p)
GetNext = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(ArrowDeviceArrayStream), ctypes.POINTER(ArrowDeviceArray)
)
GetLastError = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(ArrowDeviceArrayStream))
ReleaseStream = ctypes.CFUNCTYPE(None, ctypes.POINTER(ArrowDeviceArrayStream))
ArrowDeviceArrayStream._fields_ = [
    ("device_type", ctypes.c_int32),
    ("get_schema", GetSchema),
    ("get_next", GetNext),
    ("get_last_error", GetLastError),
    ("release", ReleaseStream),
    ("private_data", ctypes.c_void_p),
]


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    pass


DeleteTensor = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [
    ("dl_tensor", DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", DeleteTensor),
]

# PyCapsules, through the C API. Item access makes function objects of our own, so the
# argument types set here cannot clash with another library's use of ctypes.pythonapi.

CapsuleDestructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_capsule_new = ctypes.pythonapi["PyCapsule_New"]
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, CapsuleDestructor]
_capsule_pointer = ctypes.pythonapi["PyCapsule_GetPointer"]
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_capsule_is_valid = ctypes.pythonapi["PyCapsule_IsValid"]
_capsule_is_valid.restype = ctypes.c_int
_capsule_is_valid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_object_capsule_pointer = ctypes.pythonapi["PyCapsule_GetPointer"]
_object_capsule_pointer.restype = ctypes.c_void_p
_object_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]

# Capsule names must outlive their capsules: module constants do.
DEVICE_ARRAY = b"arrow_device_array"
DEVICE_STREAM = b"arrow_device_array_stream"
DLTENSOR = b"dltensor"

# What the structs handed out point into, by the key in their private_data (or manager_ctx),
# until the consumer releases the struct; and the memory of each capsule's struct, by its
# address, until the capsule is collected. Release callbacks run on whatever thread the
# consumer calls them from: the lock orders the changes.
_lock = threading.Lock()
_keys = itertools.count(1)
_live: dict[int, Any] = {}
_capsule_memory: dict[int, Any] = {}


def _register(owner: Any) -> int:
    with _lock:
        key = next(_keys)
        _live[key] = owner
    return key


def _unregister(key: Optional[int], _lock: Any = _lock, _live: dict[int, Any] = _live) -> Any:
    if key is None:
        return None
    with _lock:
        return _live.pop(key, None)


def _capsule(memory: Any, name: bytes, destructor: Any) -> Any:
    """A capsule named `name` around the ctypes struct `memory`, kept until it is collected."""
    pointer = ctypes.addressof(memory)
    with _lock:
        _capsule_memory[pointer] = memory
    return _capsule_new(pointer, name, destructor)


def _drop_capsule_memory(
    pointer: Optional[int], _lock: Any = _lock, _memory: dict[int, Any] = _capsule_memory
) -> Any:
    if not pointer:
        return None
    with _lock:
        return _memory.pop(pointer, None)


def capsule_pointer(capsule: Any, name: bytes) -> int:
    """The pointer in a capsule named `name` (ValueError if it is named otherwise)."""
    pointer: Optional[int] = _object_capsule_pointer(capsule, name)
    if not pointer:
        raise ValueError(f"not a {name.decode()} capsule")
    return pointer


# Arrow arrays.


def _fixed_width(data_type: pa.DataType) -> bool:
    try:
        return bool(data_type.num_fields == 0 and data_type.bit_width > 0)
    except ValueError:  # no bit width: a variable-width type
        return False


def storage(data_type: pa.DataType) -> pa.DataType:
    """The type whose layout holds `data_type`'s values (an extension type's storage)."""
    return data_type.storage_type if isinstance(data_type, pa.BaseExtensionType) else data_type


def buffer_kinds(data_type: pa.DataType) -> list[str]:
    """The kinds of `data_type`'s buffers in Arrow C data order: the export document names
    buffers by kind, and a consumer expects every slot of the layout (absent ones NULL)."""
    data_type = storage(data_type)
    if pa.types.is_null(data_type):
        return []
    if pa.types.is_dictionary(data_type):
        return ["validity", "values"]
    if (
        pa.types.is_string(data_type)
        or pa.types.is_large_string(data_type)
        or pa.types.is_binary(data_type)
        or pa.types.is_large_binary(data_type)
    ):
        return ["validity", "offsets", "values"]
    if pa.types.is_list(data_type) or pa.types.is_large_list(data_type) or pa.types.is_map(data_type):
        return ["validity", "offsets"]
    if pa.types.is_struct(data_type) or pa.types.is_fixed_size_list(data_type):
        return ["validity"]
    if _fixed_width(data_type):  # booleans included
        return ["validity", "values"]
    raise NotImplementedError(f"columns of type {data_type} cannot be described to Arrow consumers yet")


def child_types(data_type: pa.DataType) -> list[pa.DataType]:
    data_type = storage(data_type)
    if pa.types.is_map(data_type):
        # One child: the entries struct of key and item.
        return [pa.struct([data_type.key_field, data_type.item_field])]
    return [data_type.field(i).type for i in range(data_type.num_fields)]


class _Node:
    """One ArrowArray handed out, with the memory its pointers point into."""

    def __init__(self, struct: ArrowArray, pin: Pin) -> None:
        self.struct = struct
        self.pin = pin
        self.keep: list[Any] = []  # pointer arrays and child structs this struct points into
        pin.acquire()


def _fill(
    struct: ArrowArray,
    *,
    length: int,
    null_count: int,
    buffers: Sequence[Optional[int]],
    children: Sequence[ArrowArray],
    dictionary: Optional[ArrowArray],
    pin: Pin,
) -> None:
    node = _Node(struct, pin)
    pointers = (ctypes.c_void_p * max(1, len(buffers)))(*buffers)
    child_pointers = (ctypes.POINTER(ArrowArray) * max(1, len(children)))(
        *[ctypes.pointer(child) for child in children]
    )
    node.keep += [pointers, child_pointers, *children]
    if dictionary is not None:
        node.keep.append(dictionary)
    struct.length = length
    struct.null_count = null_count
    struct.offset = 0
    struct.n_buffers = len(buffers)
    struct.n_children = len(children)
    struct.buffers = pointers
    struct.children = child_pointers
    struct.dictionary = ctypes.pointer(dictionary) if dictionary is not None else None
    struct.private_data = _register(node)
    struct.release = _release_array


_null_release = ReleaseArray()


def _on_release_array(
    array: Any, _unregister: Any = _unregister, _sys: Any = sys, _null_release: Any = _null_release
) -> None:
    struct = array.contents
    node = _unregister(struct.private_data)
    for i in range(struct.n_children):
        child = struct.children[i].contents
        if child.release:  # not moved out by the consumer
            child.release(struct.children[i])
    if struct.dictionary and struct.dictionary.contents.release:
        struct.dictionary.contents.release(struct.dictionary)
    struct.release = _null_release
    if node is not None and not _sys.is_finalizing():  # at exit the leases are released already
        node.pin.release()


_release_array = ReleaseArray(_on_release_array)


def _release_filled(structs: Sequence[ArrowArray]) -> None:
    """Releases those of `structs` filled before a failure, so none keeps its pin."""
    for struct in structs:
        if struct.release:
            struct.release(ctypes.pointer(struct))


def column_array(
    struct: ArrowArray, data_type: pa.DataType, doc: dict[str, Any], base: int, pin: Pin
) -> None:
    """Fills `struct` with the array the export document `doc` describes (a column, a child or
    a dictionary), whose buffers lie at their `offset`s from `base`."""
    by_kind = {buffer["kind"]: base + int(buffer["offset"]) for buffer in doc["buffers"]}
    buffers = [by_kind.get(kind) for kind in buffer_kinds(data_type)]
    types = child_types(data_type)
    if len(types) != len(doc["children"]):
        raise ValueError(
            f"the export document gives {len(doc['children'])} children for {data_type}, "
            f"which has {len(types)}"
        )
    children = [ArrowArray() for _ in types]
    dictionary = ArrowArray() if pa.types.is_dictionary(storage(data_type)) else None
    try:
        for child, child_type, child_doc in zip(children, types, doc["children"]):
            column_array(child, child_type, child_doc, base, pin)
        if dictionary is not None:
            column_array(dictionary, storage(data_type).value_type, doc["dictionary"], base, pin)
    except BaseException:
        _release_filled([*children, *([dictionary] if dictionary is not None else [])])
        raise
    _fill(
        struct,
        length=int(doc["length"]),
        null_count=int(doc["null_count"]),
        buffers=buffers,
        children=children,
        dictionary=dictionary,
        pin=pin,
    )


@dataclass(frozen=True)
class DevicePart:
    """Rows held together on one device, as `ArrowDeviceArray`s describe them: the columns'
    export documents and the address each column's allocation is mapped at here."""

    schema: pa.Schema
    num_rows: int
    columns: Sequence[dict[str, Any]]
    bases: Sequence[int]
    device_type: int
    device_id: int
    sync_event: Optional[int]  # the address of a CUevent, or None
    pin: Pin


def batch_array(out: ArrowDeviceArray, part: DevicePart) -> None:
    """Fills `out` with `part` as one struct array (a record batch) on its device."""
    children = [ArrowArray() for _ in part.columns]
    try:
        for child, field, doc, base in zip(children, part.schema, part.columns, part.bases):
            column_array(child, field.type, doc, base, part.pin)
    except BaseException:
        _release_filled(children)
        raise
    _fill(
        out.array,
        length=part.num_rows,
        null_count=0,
        buffers=[None],
        children=children,
        dictionary=None,
        pin=part.pin,
    )
    out.device_id = part.device_id
    out.device_type = part.device_type
    out.sync_event = part.sync_event


def _on_drop_device_array(
    capsule: int,
    _drop: Any = _drop_capsule_memory,
    _pointer: Any = _capsule_pointer,
    _name: bytes = DEVICE_ARRAY,
) -> None:
    device_array = _drop(_pointer(capsule, _name))
    if device_array is not None and device_array.array.release:
        device_array.array.release(ctypes.pointer(device_array.array))


_drop_device_array = CapsuleDestructor(_on_drop_device_array)


def check_request(requested_schema: Any, schema: pa.Schema, kwargs: dict[str, Any]) -> None:
    """The PyCapsule interface's arguments. Unknown keywords with values are refused. A
    requested schema is honoured as the specification allows: the data comes in its own
    schema (casting would copy device memory), and a request with other fields is refused."""
    unknown = sorted(key for key, value in kwargs.items() if value is not None)
    if unknown:
        raise NotImplementedError(f"unsupported keyword arguments: {', '.join(unknown)}")
    if requested_schema is not None:
        requested = pa.Schema._import_from_c_capsule(requested_schema)
        if requested.names != schema.names:
            raise ValueError(f"the requested schema's fields {requested.names} are not {schema.names}")


def device_array_capsules(part: DevicePart) -> tuple[Any, Any]:
    """`__arrow_c_device_array__`'s answer: the `arrow_schema` and `arrow_device_array`
    capsules of `part` as one record batch."""
    out = ArrowDeviceArray()
    batch_array(out, part)
    schema_capsule = part.schema.__arrow_c_schema__()
    return schema_capsule, _capsule(out, DEVICE_ARRAY, _drop_device_array)


# Streams.


class _Stream:
    def __init__(self, schema: pa.Schema, parts: Iterator[DevicePart], pin: Pin) -> None:
        self.schema = schema
        self.parts = parts
        self.pin = pin
        self.error: Optional[bytes] = None
        pin.acquire()  # the parts it has yet to give are mapped until it is released


def _on_stream_schema(stream: Any, out: int) -> int:
    state = _live.get(stream.contents.private_data)
    if state is None:
        return 22  # EINVAL: released
    try:
        state.schema._export_to_c(out)
    except BaseException as error:  # an interrupt too: nothing may escape into C
        state.error = f"{type(error).__name__}: {error}".encode()
        return 5  # EIO
    return 0


_stream_schema = GetSchema(_on_stream_schema)


def _on_stream_next(stream: Any, out: Any) -> int:
    state = _live.get(stream.contents.private_data)
    if state is None:
        return 22
    ctypes.memset(out, 0, ctypes.sizeof(ArrowDeviceArray))
    try:
        part = next(state.parts, None)
        if part is not None:
            batch_array(out.contents, part)
    except BaseException as error:  # an interrupt too: nothing may escape into C
        state.error = f"{type(error).__name__}: {error}".encode()
        return 5
    return 0  # with release NULL at the end of the stream


_stream_next = GetNext(_on_stream_next)


def _on_stream_error(stream: Any) -> Optional[int]:
    state = _live.get(stream.contents.private_data)
    if state is None or state.error is None:
        return None
    # The bytes stay alive in `state` until the next call or the release, as the spec asks.
    return ctypes.cast(ctypes.c_char_p(state.error), ctypes.c_void_p).value


_stream_error = GetLastError(_on_stream_error)


def _on_release_stream(stream: Any, _unregister: Any = _unregister, _sys: Any = sys) -> None:
    state = _unregister(stream.contents.private_data)
    stream.contents.release = ReleaseStream()
    if state is not None and not _sys.is_finalizing():
        state.pin.release()


_release_stream = ReleaseStream(_on_release_stream)


def _on_drop_stream(
    capsule: int,
    _drop: Any = _drop_capsule_memory,
    _pointer: Any = _capsule_pointer,
    _name: bytes = DEVICE_STREAM,
) -> None:
    stream = _drop(_pointer(capsule, _name))
    if stream is not None and stream.release:
        stream.release(ctypes.pointer(stream))


_drop_stream = CapsuleDestructor(_on_drop_stream)


def device_stream_capsule(device_type: int, schema: pa.Schema, parts: Iterator[DevicePart], pin: Pin) -> Any:
    """`__arrow_c_device_stream__`'s answer: an `arrow_device_array_stream` capsule yielding
    each of `parts` as a record batch, made when the consumer asks for it."""
    stream = ArrowDeviceArrayStream()
    stream.device_type = device_type
    stream.get_schema = _stream_schema
    stream.get_next = _stream_next
    stream.get_last_error = _stream_error
    stream.release = _release_stream
    stream.private_data = _register(_Stream(schema, parts, pin))
    return _capsule(stream, DEVICE_STREAM, _drop_stream)


# DLPack.


def dlpack_type(dtype_char: str, itemsize: int) -> DLDataType:
    """DLPack's type of NumPy kind `dtype_char` ('i', 'u', 'f' or 'b') of `itemsize` bytes."""
    code = {"i": 0, "u": 1, "f": 2, "b": 6}[dtype_char]
    return DLDataType(code, itemsize * 8, 1)


def _on_delete_tensor(managed: Any, _unregister: Any = _unregister, _sys: Any = sys) -> None:
    kept = _unregister(managed.contents.manager_ctx)
    if kept is not None and not _sys.is_finalizing():
        kept[0].release()


_delete_tensor = DeleteTensor(_on_delete_tensor)


def _on_drop_tensor(
    capsule: int,
    _valid: Any = _capsule_is_valid,
    _pointer: Any = _capsule_pointer,
    _name: bytes = DLTENSOR,
    _ctypes: Any = ctypes,
    _managed: Any = DLManagedTensor,
) -> None:
    # A consumer renames the capsule "used_dltensor" when it takes the tensor, and calls its
    # deleter when done; one still named "dltensor" was never taken, so it is deleted here.
    if _valid(capsule, _name):
        managed = _ctypes.cast(_pointer(capsule, _name), _ctypes.POINTER(_managed))
        managed.contents.deleter(managed)


_drop_tensor = CapsuleDestructor(_on_drop_tensor)


def dlpack_capsule(
    pointer: int, length: int, dtype: DLDataType, device_type: int, device_id: int, pin: Pin
) -> Any:
    """A `dltensor` capsule of a one-dimensional array of `length` values at `pointer`. The
    tensor's memory is kept until its deleter runs, which may be long after the capsule."""
    managed = DLManagedTensor()
    shape = (ctypes.c_int64 * 1)(length)
    tensor = managed.dl_tensor
    tensor.data = pointer
    tensor.device = DLDevice(device_type, device_id)
    tensor.ndim = 1
    tensor.dtype = dtype
    tensor.shape = shape
    tensor.strides = None  # compact, row-major
    tensor.byte_offset = 0
    pin.acquire()
    managed.manager_ctx = _register((pin, managed, shape))
    managed.deleter = _delete_tensor
    return _capsule_new(ctypes.addressof(managed), DLTENSOR, _drop_tensor)


# Consumers may release what they hold at any time, interpreter shutdown included, when the
# module's globals may already be collected or cleared: the callbacks are made immortal (and
# hold what they use in default arguments), so a late release never runs through freed memory.
_increment = ctypes.pythonapi["Py_IncRef"]
_increment.argtypes = [ctypes.py_object]
_increment.restype = None
for _kept in (
    _release_array,
    _drop_device_array,
    _stream_schema,
    _stream_next,
    _stream_error,
    _null_release,
    _release_stream,
    _drop_stream,
    _delete_tensor,
    _drop_tensor,
    _live,
    _capsule_memory,
    _lock,
    DEVICE_ARRAY,
    DEVICE_STREAM,
    DLTENSOR,
    _capsule_pointer,
    _capsule_is_valid,
    _unregister,
    _drop_capsule_memory,
):
    _increment(_kept)
del _kept
