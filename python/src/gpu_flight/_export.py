"""Zero-copy exports: a dataset's GPU memory mapped into this process (`Client.export`).

The server's `ipc-export` action grants a lease and describes every partition's columns as
CUDA IPC handles with byte offsets (docs/protocol.md). `Export` opens the handles on the GPUs
this process sees and hands the memory on, without copying it, in the forms GPU libraries take:
the Arrow PyCapsule device protocol (`__arrow_c_device_array__`, `__arrow_c_device_stream__`)
for pylibcudf/cuDF, nanoarrow and CUDA-enabled pyarrow, and per column
`__cuda_array_interface__` and DLPack for CuPy, PyTorch and Numba.

Lifetime. The lease ends, and the memory is unmapped, once the `Export` is closed (or
collected) and nothing taken from it is alive: a Column, a CuPy or PyTorch view of one, a
DLPack tensor, an Arrow device array a consumer imported. So nothing handed out ever points at
unmapped memory. The server bounds it all: after `lease_seconds` it may free the memory
whatever this process holds, so views must not outlive the lease (`renew()` extends it). At
interpreter exit every lease still held is released.
"""

from __future__ import annotations

import base64
import functools
import logging
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, Optional

import pyarrow as pa

from . import _cdata, _cuda, _cudf
from ._actions import Actions
from ._documents import parse
from ._lease import RELEASE_SECONDS, _Held, _Lease, _release, _start_lease_thread, end_pending

log = logging.getLogger("gpu_flight")

DOCUMENT_VERSION = 2
DEFAULT_LEASE_SECONDS = 300


class DeviceNotVisible(RuntimeError):
    """The dataset lives on a GPU this process cannot see: another node, or one hidden by
    `CUDA_VISIBLE_DEVICES`. Read it with `Client.get` there."""


def _typestr(data_type: pa.DataType) -> Optional[str]:
    """The array-interface type string of a fixed-width column's values, or None."""
    if pa.types.is_dictionary(data_type):
        data_type = data_type.index_type
    if pa.types.is_integer(data_type):
        kind = "i" if pa.types.is_signed_integer(data_type) else "u"
    elif pa.types.is_floating(data_type):
        kind = "f"
    elif pa.types.is_temporal(data_type) and not pa.types.is_interval(data_type):
        kind = "i"  # dates, times, timestamps and durations are integers
    else:
        return None
    width = data_type.bit_width // 8
    return f"{'|' if width == 1 else '<'}{kind}{width}"


class Bitmap(_Held):
    """An Arrow validity bitmap (bit i set: row i is valid, least significant bit first), as
    a `__cuda_array_interface__` of bytes."""

    def __init__(self, lease: _Lease, pointer: int, nbytes: int, ordinal: int) -> None:
        super().__init__(lease)
        self.pointer, self.nbytes, self.device = pointer, nbytes, ordinal

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        self._check()
        return {
            "shape": (self.nbytes,),
            "typestr": "|u1",
            "data": (self.pointer, True),
            "strides": None,
            "version": 3,
            "stream": None,
        }


class Column(_Held):
    """One exported column of one partition: `name`, `type`, `length`, `null_count` and
    `device` (this process's CUDA ordinal it is mapped on).

    A fixed-width column (integers, floats, dates, times, timestamps, durations; a dictionary
    column's keys) is a one-dimensional array through `__cuda_array_interface__` and DLPack:
    `cupy.asarray(column)`, `torch.from_dlpack(column)`. These views are the server's memory:
    never write to them (copy first). The interface marks them read-only, which CuPy does not
    enforce and PyTorch's `as_tensor` refuses (use DLPack there); DLPack 0.8 has no read-only
    flag, so a tensor is writable. Its nulls hold arbitrary values;
    `validity` is the bitmap that says which. Every column is reachable through the Arrow
    device protocol of its partition, and `to_arrow()` copies it to the host.
    """

    def __init__(self, lease: _Lease, field: pa.Field, doc: dict[str, Any], base: int, ordinal: int) -> None:
        super().__init__(lease)
        self.name: str = field.name
        self.type: pa.DataType = field.type
        self.length = int(doc["length"])
        self.null_count = int(doc["null_count"])
        self.device = ordinal
        self._doc = doc
        self._base = base

    def __repr__(self) -> str:
        return f"<gpu_flight.Column {self.name!r} {self.type} length={self.length} device={self.device}>"

    def buffers(self) -> dict[str, tuple[int, int]]:
        """This array's own buffers (not its children's) as {kind: (device address, bytes)}:
        `validity`, `offsets`, `values`, in Arrow's layout."""
        self._check()
        return {b["kind"]: (self._base + int(b["offset"]), int(b["length"])) for b in self._doc["buffers"]}

    @property
    def validity(self) -> Optional[Bitmap]:
        """The validity bitmap, or None when the column has no nulls."""
        found = self.buffers().get("validity")
        return None if found is None else Bitmap(self._lease, found[0], found[1], self.device)

    def _values(self) -> tuple[str, int]:
        typestr = _typestr(_cdata.storage(self.type))
        if typestr is None:
            raise TypeError(
                f"column {self.name!r} is {self.type}: only fixed-width integer, float and "
                "temporal columns (and dictionary keys) are typed arrays; take the column "
                "through the Arrow device protocol (its partition), or to_arrow()"
            )
        pointer, _ = self.buffers().get("values", (0, 0))
        return typestr, pointer

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        typestr, pointer = self._values()
        return {
            "shape": (self.length,),
            "typestr": typestr,
            "data": (pointer if self.length else 0, True),
            "strides": None,
            "version": 3,
            "stream": None,  # the data is complete: nothing to wait for
        }

    def __dlpack_device__(self) -> tuple[int, int]:
        return (_cdata.DLPACK_CUDA, self.device)

    def __dlpack__(
        self,
        *,
        stream: Optional[int] = None,
        max_version: Optional[tuple[int, int]] = None,
        dl_device: Optional[tuple[int, int]] = None,
        copy: Optional[bool] = None,
    ) -> Any:
        """A DLPack capsule of the values (unversioned `dltensor`: this producer writes
        DLPack 0.8, which the standard lets a consumer asking for 1.x accept). `stream` is
        ignored: the data is complete, with nothing queued to wait for. A copy, or another
        device, is refused (BufferError)."""
        if copy:
            raise BufferError("an export's columns are views of the server's memory: copy the result")
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(f"column {self.name!r} is on CUDA device {self.device}, not {dl_device}")
        typestr, pointer = self._values()
        dtype = _cdata.dlpack_type(typestr[1], int(typestr[2:]))
        return _cdata.dlpack_capsule(
            pointer, self.length, dtype, _cdata.DLPACK_CUDA, self.device, self._lease
        )

    def to_arrow(self) -> pa.Array:
        """A host copy of the column as a pyarrow Array."""
        self._check()
        return _host_array(self.type, self._doc, self._base, self.device)


def _host_array(data_type: pa.DataType, doc: dict[str, Any], base: int, ordinal: int) -> pa.Array:
    layout = _cdata.storage(data_type)
    if pa.types.is_null(layout):
        return pa.nulls(int(doc["length"]), data_type)
    by_kind = {
        b["kind"]: pa.py_buffer(_cuda.copy_to_host(base + int(b["offset"]), int(b["length"]), ordinal))
        for b in doc["buffers"]
    }
    buffers = [by_kind.get(kind) for kind in _cdata.buffer_kinds(layout)]
    children = [
        _host_array(child_type, child, base, ordinal)
        for child_type, child in zip(_cdata.child_types(layout), doc["children"])
    ]
    length, null_count = int(doc["length"]), int(doc["null_count"])
    if pa.types.is_dictionary(layout):
        indices = pa.Array.from_buffers(layout.index_type, length, buffers, null_count)
        dictionary = _host_array(layout.value_type, doc["dictionary"], base, ordinal)
        array = pa.DictionaryArray.from_arrays(indices, dictionary)
    else:
        array = pa.Array.from_buffers(layout, length, buffers, null_count, children=children)
    if layout is not data_type:
        return pa.ExtensionArray.from_storage(data_type, array)
    return array


class Partition:
    """Rows of an export held together on one GPU, in row order among the export's partitions.

    `num_rows`; `access` ("local", "peer" or "replica", docs/protocol.md); `server_device`, the
    server's number for the GPU holding them; `device`, this process's ordinal they are mapped
    on; `columns`, {name: Column}. Implements `__arrow_c_device_array__`: the partition as one
    record batch on `device`.
    """

    def __init__(self, lease: _Lease, schema: pa.Schema, doc: dict[str, Any], ordinal: int) -> None:
        self._lease = lease
        self.schema = schema
        self.num_rows = int(doc["num_rows"])
        self.access: str = doc["access"]
        self.server_device: Optional[int] = doc["device"].get("device")
        self.device = ordinal
        self._docs: list[dict[str, Any]] = doc["columns"]
        self._bases: list[int] = []
        for column in self._docs:
            handle = base64.b64decode(column["handle"])
            self._bases.append(_cuda.MAPPINGS.acquire(handle, ordinal))
            lease.mappings.append((handle, ordinal))
        self.columns = {
            field.name: Column(lease, field, column, base, ordinal)
            for field, column, base in zip(schema, self._docs, self._bases)
        }

    def __repr__(self) -> str:
        return (
            f"<gpu_flight.Partition rows={self.num_rows} access={self.access} "
            f"device={self.device} columns={list(self.columns)}>"
        )

    def __getitem__(self, name: str) -> Column:
        return self.columns[name]

    def _part(self) -> _cdata.DevicePart:
        return _cdata.DevicePart(
            schema=self.schema,
            num_rows=self.num_rows,
            columns=self._docs,
            bases=self._bases,
            device_type=_cdata.ARROW_DEVICE_CUDA,
            device_id=self.device,
            sync_event=self._lease.event(self.device).address,
            pin=self._lease,
        )

    def __arrow_c_device_array__(self, requested_schema: Any = None, **kwargs: Any) -> tuple[Any, Any]:
        """The partition as an Arrow record batch on its CUDA device (PyCapsule protocol)."""
        _cdata.check_request(requested_schema, self.schema, kwargs)
        return _cdata.device_array_capsules(self._part())

    def to_arrow(self) -> pa.RecordBatch:
        """A host copy of the partition."""
        return pa.record_batch([column.to_arrow() for column in self.columns.values()], schema=self.schema)


class Export:
    """A dataset's columns mapped from a gpu-flight server on this node, under a lease
    (`Client.export` makes one).

    `name`, `schema`, `num_rows`, `lease`, `expires_at`, `document` (the server's), and
    `partitions` in row order. Implements `__arrow_c_device_stream__` (every partition, each
    a record batch on its device) and, for a dataset held in one partition,
    `__arrow_c_device_array__`, `columns` and `export["column"]`.

    A context manager: leaving the block closes it (see the module's docstring for when the
    lease ends).
    """

    def __init__(self, client: Actions, name: str, document: dict[str, Any]) -> None:
        self.name = name
        self.document = document
        self.lease: str = document["lease"]
        self._client = client
        # The lease holds the client, never this object, which it may outlive.
        self._state = _Lease(functools.partial(_release, client), self.lease)
        self._close = weakref.finalize(self, self._state.release)
        self.partitions: list[Partition] = []
        try:
            if document.get("version") != DOCUMENT_VERSION:
                raise RuntimeError(f"unsupported export document version {document.get('version')}")
            self.expires_at: str = document["expires_at"]
            self.num_rows = int(document["num_rows"])
            self.schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(document["schema"])))
            for part in document["partitions"]:
                _check_partition(self.schema, part)
                where = document["consumer_device"] if part["access"] == "peer" else part["device"]
                ordinal = _cuda.find_device(where["uuid"], where["pci_bus_id"])
                if ordinal is None:
                    raise DeviceNotVisible(
                        f"{name!r} lives on GPU {where['uuid']} (PCI {where['pci_bus_id']}) of the "
                        "server's node, which this process cannot see: run on that node with the "
                        "GPU visible (check CUDA_VISIBLE_DEVICES), or read it with Client.get"
                    )
                self.partitions.append(Partition(self._state, self.schema, part, ordinal))
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"expires {self.expires_at}"
        parts = len(self.partitions)
        return f"<gpu_flight.Export {self.name!r} rows={self.num_rows} partitions={parts} {state}>"

    @property
    def closed(self) -> bool:
        return not self._close.alive

    @property
    def released(self) -> bool:
        """Whether the lease has ended: closed, and nothing taken from the export is alive."""
        return self._state.ended

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"the export of {self.name!r} is closed")

    def _only(self) -> Partition:
        self._check_open()
        if len(self.partitions) != 1:
            raise ValueError(
                f"{self.name!r} is held in {len(self.partitions)} partitions (it spans several GPUs "
                "or batches): use .partitions, the Arrow device stream, or to_arrow()"
            )
        return self.partitions[0]

    @property
    def columns(self) -> dict[str, Column]:
        """{name: Column} of a dataset held in one partition."""
        return self._only().columns

    def __getitem__(self, name: str) -> Column:
        return self._only()[name]

    def __arrow_c_device_array__(self, requested_schema: Any = None, **kwargs: Any) -> tuple[Any, Any]:
        """A dataset held in one partition as an Arrow record batch on its device."""
        return self._only().__arrow_c_device_array__(requested_schema, **kwargs)

    def __arrow_c_device_stream__(self, requested_schema: Any = None, **kwargs: Any) -> Any:
        """Every partition, in row order, each an Arrow record batch on its device."""
        self._check_open()
        _cdata.check_request(requested_schema, self.schema, kwargs)
        parts: Iterator[_cdata.DevicePart] = (partition._part() for partition in list(self.partitions))
        return _cdata.device_stream_capsule(_cdata.ARROW_DEVICE_CUDA, self.schema, parts, self._state)

    def to_arrow(self) -> pa.Table:
        """A host copy of every exported column of every partition."""
        self._check_open()
        return pa.Table.from_batches([p.to_arrow() for p in self.partitions], schema=self.schema)

    def to_cudf(self) -> Any:
        """The export as a `cudf.DataFrame` (cuDF 25.08 or later), zero-copy where cuDF's layout
        allows: its columns are then the server's memory, valid while the lease lasts and
        kept mapped while the frame lives. Write to a copy (`frame.copy(deep=True)`), never in
        place. `cudf_copies()` says which columns are copied instead, and why."""
        self._check_open()
        return _cudf.to_cudf(self)

    def cudf_copies(self) -> dict[str, str]:
        """{column: why} for the columns `to_cudf()` copies rather than hands over in place.
        Decided from the schema and the partitions alone; needs no cuDF."""
        return _cudf.plan(self)

    def renew(self, lease_seconds: int = DEFAULT_LEASE_SECONDS) -> str:
        """Extends the lease to `lease_seconds` from now; returns the new expiry (RFC 3339).
        Works after `close()` too, while views taken from the export keep it."""
        if self.released:
            raise RuntimeError(f"the export of {self.name!r} has ended: its lease is released")
        body = {
            "name": self.name,
            "lease": self.lease,
            "lease_seconds": lease_seconds,
            "version": DOCUMENT_VERSION,
        }
        renewed = self._client._action("ipc-export", body)
        self.expires_at = parse(renewed, "ipc-export result")["expires_at"]
        return self.expires_at

    def close(self) -> None:
        """Gives up this object's hold on the memory. The lease ends at once unless views taken
        from the export are still alive; then it ends with the last of them. Idempotent."""
        self.partitions = []
        self._close()
        end_pending()
        if self._state.ended:  # nothing taken from it is alive: done when this returns
            self._state.done.wait(2 * RELEASE_SECONDS)

    def __enter__(self) -> Export:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_partition(schema: pa.Schema, part: dict[str, Any]) -> None:
    """What the structs built from a partition's document rely on: a column per field, and
    handles of CUDA's size."""
    if len(part["columns"]) != len(schema):
        raise RuntimeError(
            f"the export document lists {len(part['columns'])} columns for a schema of {len(schema)}"
        )
    for column in part["columns"]:
        if len(base64.b64decode(column["handle"])) != IPC_HANDLE_BYTES:
            raise RuntimeError(f"column {column['name']!r} has no {IPC_HANDLE_BYTES}-byte CUDA IPC handle")


IPC_HANDLE_BYTES = 64


def device_uuid(ordinal: int) -> str:
    """The UUID ("GPU-…") of this process's CUDA device `ordinal`: how to name this process's
    GPU to the server, whose device numbers differ from the ordinals here (for example
    `client.move(name, gpu_flight.device_uuid(0))`). Needs `cuda-bindings`."""
    return _cuda.uuid(ordinal)


def consumer_device(device: Any) -> str:
    """The server's name for the consumer's GPU: a UUID as given, or this process's ordinal's."""
    if isinstance(device, str):
        return device
    if isinstance(device, int) and not isinstance(device, bool):
        return device_uuid(device)
    raise TypeError(f"device must be this process's CUDA ordinal or a GPU UUID, not {device!r}")


def open_export(
    client: Actions,
    name: str,
    columns: Optional[Sequence[str]],
    device: Any,
    copy: bool,
    lease_seconds: int,
) -> Export:
    body: dict[str, Any] = {"name": name, "lease_seconds": lease_seconds, "version": DOCUMENT_VERSION}
    if columns is not None:
        if isinstance(columns, str):
            raise TypeError("columns must be a sequence of column names, not a string")
        body["columns"] = list(columns)
    if device is not None:
        body["device"] = consumer_device(device)
        body["copy"] = bool(copy)
    elif copy:
        raise ValueError("copy=True copies onto this process's GPU: pass device=")
    _start_lease_thread()
    end_pending()
    return Export(client, name, parse(client._action("ipc-export", body), "ipc-export result"))
