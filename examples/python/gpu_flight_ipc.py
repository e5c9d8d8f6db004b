"""Zero-copy access to a gpu-flight dataset from a process on the server's node.

Drop this file next to your code. It needs pyarrow and CuPy; PyTorch and cuDF are optional.

    import pyarrow.flight as flight
    from gpu_flight_ipc import ExportedDataset

    client = flight.connect("grpc://127.0.0.1:8815")
    with ExportedDataset(client, "trips", columns=["fare", "city"], device=0) as trips:
        fares = trips["fare"].to_cupy()      # a CuPy view of the server's GPU memory
        tensor = trips["fare"].to_torch()    # the same memory as a PyTorch tensor (DLPack)
        valid = trips["fare"].validity()     # the Arrow validity bitmap (CuPy uint8) or None
        check = trips["city"].to_arrow()     # a host copy as a pyarrow array
    # leaving the block unmaps the memory and releases the lease

A dataset larger than one GPU is held in several partitions, each on one GPU:
`trips.partitions` lists them (rows, device, columns), and `trips["fare"]` works only for a
dataset of one partition. `device` is the CuPy ordinal this process computes on: partitions
on another GPU are mapped on it for peer access (read over NVLink or PCIe), or, with
`copy=True`, copied onto it by the server for the lease (the server's write role needed).

Views are valid until the dataset is closed (or the lease, 300 s by default, runs out):
copy what you keep (`.copy()`). Each distinct IPC handle is opened once per process and
device, however many exports use it. On another node, or where CUDA_VISIBLE_DEVICES hides
the server's GPU, `DeviceNotVisible` says so: read the dataset with DoGet there.
"""

import base64
import functools
import json
import threading

import cupy as cp
import pyarrow as pa
import pyarrow.flight as flight

DOCUMENT_VERSION = 2


class DeviceNotVisible(RuntimeError):
    """The dataset lives on a GPU this process cannot see (another node, or hidden)."""


def _uuid_string(raw):
    """CUDA's 16 UUID bytes as nvidia-smi prints them."""
    h = bytes(raw).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


@functools.cache
def device_uuid(ordinal):
    """The UUID of this process's CuPy device `ordinal`: what the server knows it by."""
    props = cp.cuda.runtime.getDeviceProperties(ordinal)
    if "uuid" not in props:
        raise RuntimeError("this CuPy does not report device UUIDs, by which the server knows its GPUs")
    return _uuid_string(props["uuid"])


_DEVICES = {}


def find_device(uuid, pci_bus_id):
    """This process's CuPy ordinal of the GPU with this UUID or PCI bus id, or None.
    Remembered per process: the visible devices do not change while it runs."""
    key = (uuid, pci_bus_id.lower())
    if key not in _DEVICES:
        _DEVICES[key] = _search_devices(uuid, pci_bus_id.lower())
    return _DEVICES[key]


def _search_devices(uuid, pci_bus_id):
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except cp.cuda.runtime.CUDARuntimeError:
        return None
    for ordinal in range(count):
        props = cp.cuda.runtime.getDeviceProperties(ordinal)
        if "uuid" in props and _uuid_string(props["uuid"]) == uuid:
            return ordinal
        if cp.cuda.Device(ordinal).pci_bus_id.lower() == pci_bus_id:
            return ordinal
    return None


class _Mappings:
    """Process-wide: each handle opened once per device, closed when its last user is done."""

    def __init__(self):
        self._lock = threading.Lock()
        self._open = {}  # (handle bytes, device) -> [pointer, users]

    def acquire(self, handle, device):
        with self._lock:
            entry = self._open.get((handle, device))
            if entry is None:
                with cp.cuda.Device(device):
                    pointer = cp.cuda.runtime.ipcOpenMemHandle(
                        handle, cp.cuda.runtime.cudaIpcMemLazyEnablePeerAccess
                    )
                entry = self._open[(handle, device)] = [pointer, 0]
            entry[1] += 1
            return entry[0]

    def release(self, handle, device):
        with self._lock:
            entry = self._open[(handle, device)]
            entry[1] -= 1
            if entry[1] == 0:
                del self._open[(handle, device)]
                with cp.cuda.Device(device):
                    cp.cuda.runtime.ipcCloseMemHandle(entry[0])

    def count(self):
        with self._lock:
            return len(self._open)


MAPPINGS = _Mappings()


def _storage_dtype(arrow_type):
    """The NumPy dtype of a fixed-width type's values buffer, or None."""
    if pa.types.is_integer(arrow_type) or pa.types.is_floating(arrow_type):
        return arrow_type.to_pandas_dtype()
    if pa.types.is_temporal(arrow_type):  # dates, times, timestamps, durations: integers
        return {32: "int32", 64: "int64"}[arrow_type.bit_width]
    return None


class Array:
    """One Arrow array of an exported column: buffers as CuPy views, and conversions."""

    def __init__(self, owner, base, doc, arrow_type):
        self._owner = owner  # the Partition: its device, and whether it is still open
        self.name = doc["name"]
        self.type = arrow_type
        self.length = doc["length"]
        self.null_count = doc["null_count"]
        self._buffers = [(b["kind"], base + b["offset"], b["length"]) for b in doc["buffers"]]
        self.children = [
            Array(owner, base, child, arrow_type.field(i).type)
            for i, child in enumerate(doc["children"])
        ]
        self.dictionary = (
            Array(owner, base, doc["dictionary"], arrow_type.value_type) if doc.get("dictionary") else None
        )

    def _view(self, pointer, nbytes, dtype="uint8", count=None):
        memory = cp.cuda.UnownedMemory(pointer, nbytes, self._owner, device_id=self._owner.device)
        itemsize = cp.dtype(dtype).itemsize
        count = nbytes // itemsize if count is None else count
        return cp.ndarray((count,), dtype=dtype, memptr=cp.cuda.MemoryPointer(memory, 0))

    def buffers(self):
        """{kind: CuPy uint8 view} for this array's own buffers (validity, offsets, values)."""
        self._owner._check_open()
        return {kind: self._view(pointer, nbytes) for kind, pointer, nbytes in self._buffers}

    def validity(self):
        """The validity bitmap (LSB first) as a CuPy uint8 view, or None without nulls."""
        return self.buffers().get("validity")

    def to_cupy(self):
        """The values of a fixed-width column as a typed CuPy view (nulls hold arbitrary
        values; see validity()). Dictionary columns give their keys."""
        self._owner._check_open()
        value_type = self.type.index_type if pa.types.is_dictionary(self.type) else self.type
        dtype = _storage_dtype(value_type)
        if dtype is None:
            raise TypeError(
                f"{self.name} is {self.type}: only fixed-width numeric and temporal columns are "
                "typed arrays; use buffers() for the raw Arrow buffers"
            )
        (_, pointer, nbytes), = [b for b in self._buffers if b[0] == "values"]
        return self._view(pointer, max(nbytes, 1), dtype, count=self.length)

    def to_torch(self):
        """The values as a PyTorch tensor on the same memory (DLPack, zero-copy)."""
        import torch

        return torch.from_dlpack(self.to_cupy())

    def to_cudf(self):
        """A cuDF Series of a fixed-width column (cuDF copies it into its own memory)."""
        import cudf

        series = cudf.Series(self.to_cupy())
        validity = self.validity()
        if validity is not None:
            series = series.set_mask(cp.asarray(validity).copy())
        return series

    def to_arrow(self):
        """A host copy as a pyarrow array, for checks and small results."""
        self._owner._check_open()
        host = {
            kind: pa.py_buffer(cp.asnumpy(self._view(pointer, nbytes)).tobytes()) if nbytes else pa.py_buffer(b"")
            for kind, pointer, nbytes in self._buffers
        }
        rest = [host[kind] for kind, _, _ in self._buffers if kind != "validity"]
        buffers = [host.get("validity")] + rest
        children = [child.to_arrow() for child in self.children]
        if pa.types.is_dictionary(self.type):
            indices = pa.Array.from_buffers(self.type.index_type, self.length, buffers, self.null_count)
            return pa.DictionaryArray.from_arrays(indices, self.dictionary.to_arrow())
        if pa.types.is_null(self.type):
            return pa.nulls(self.length)
        return pa.Array.from_buffers(self.type, self.length, buffers, self.null_count, children=children)


class Partition:
    """Rows of an exported dataset held together on one GPU: `num_rows`, `access` ("local",
    "peer" or "replica"), `server_device` (the server's number for the GPU holding them),
    `device` (the CuPy ordinal they are mapped on here) and `columns` ({name: Array})."""

    def __init__(self, dataset, schema, doc, device):
        self._dataset = dataset
        self.num_rows = doc["num_rows"]
        self.access = doc["access"]
        self.server_device = doc["device"].get("device")
        self.device = device
        self.columns = {}
        self._handles = []
        try:
            for field, column in zip(schema, doc["columns"]):
                handle = base64.b64decode(column["handle"])
                base = MAPPINGS.acquire(handle, device)
                self._handles.append(handle)
                self.columns[field.name] = Array(self, base, column, field.type)
        except BaseException:
            self._close()
            raise

    def _check_open(self):
        self._dataset._check_open()

    def __getitem__(self, key):
        self._check_open()
        if isinstance(key, int):
            return list(self.columns.values())[key]
        return self.columns[key]

    def _close(self):
        handles, self._handles = self._handles, []
        for handle in handles:
            try:
                MAPPINGS.release(handle, self.device)
            except Exception:  # noqa: BLE001 - unmap the rest whatever one does
                pass


class ExportedDataset:
    """A dataset's columns mapped from a gpu-flight server on this node, under a lease.

    Use as a context manager, or call close(): it unmaps the memory and releases the lease.
    `device` (a CuPy ordinal) says where this process computes; `copy=True` asks for copies
    of partitions held elsewhere on it. `options` (a pyarrow.flight.FlightCallOptions) is
    passed to every call, e.g. the `authorization` header of a server that requires
    authentication.
    """

    def __init__(self, client, name, columns=None, lease_seconds=300, options=None, device=None, copy=False):
        self._client = client
        self._options = options
        self._closed = True
        body = {"name": name, "lease_seconds": lease_seconds, "version": DOCUMENT_VERSION}
        if columns is not None:
            body["columns"] = list(columns)
        if device is not None:
            body["device"] = device_uuid(device)
            body["copy"] = bool(copy)
        elif copy:
            raise ValueError("copy=True copies onto this process's GPU: pass device=")
        self.document = self._action("ipc-export", body)
        self.name = name
        self.lease = self.document["lease"]
        self.partitions = []
        self._closed = False  # from here on, close() releases the lease
        try:
            if self.document.get("version") != DOCUMENT_VERSION:
                raise RuntimeError(f"unsupported export document version {self.document.get('version')}")
            self.expires_at = self.document["expires_at"]
            self.num_rows = self.document["num_rows"]
            self.schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(self.document["schema"])))
            for doc in self.document["partitions"]:
                where = self.document["consumer_device"] if doc["access"] == "peer" else doc["device"]
                ordinal = find_device(where["uuid"], where["pci_bus_id"])
                if ordinal is None:
                    raise DeviceNotVisible(
                        f"'{name}' lives on GPU {where['uuid']} (PCI {where['pci_bus_id']}) of the "
                        "server's node, which this process cannot see: run on that node with the GPU "
                        "visible (check CUDA_VISIBLE_DEVICES), or read the dataset with DoGet"
                    )
                self.partitions.append(Partition(self, self.schema, doc, ordinal))
        except BaseException:
            self.close()
            raise

    @property
    def columns(self):
        """{name: Array} of a dataset of one partition."""
        return self._only().columns

    @property
    def device(self):
        """The CuPy ordinal a dataset of one partition is mapped on."""
        return self._only().device

    def _only(self):
        self._check_open()
        if len(self.partitions) != 1:
            raise ValueError(
                f"'{self.name}' is held in {len(self.partitions)} partitions (it spans several GPUs): "
                "use .partitions, or to_arrow() for a host copy of all of it"
            )
        return self.partitions[0]

    def _action(self, name, body):
        action = flight.Action(name, json.dumps(body).encode())
        results = list(self._client.do_action(action, options=self._options))
        return json.loads(results[0].body.to_pybytes())

    def _release_lease(self):
        try:
            self._action("ipc-release", {"lease": self.lease})
        except pa.ArrowKeyError:
            pass  # NOT_FOUND: the lease expired already
        except flight.FlightError:
            pass  # the server is gone: the lease ends with it (or expires)

    def _check_open(self):
        if self._closed:
            raise RuntimeError(f"the export of '{self.name}' is closed; its memory is no longer mapped")

    def __getitem__(self, key):
        return self._only()[key]

    def renew(self, lease_seconds=300):
        """Extends the lease; returns the new expiry."""
        self._check_open()
        body = {"name": self.name, "lease": self.lease, "lease_seconds": lease_seconds, "version": DOCUMENT_VERSION}
        renewed = self._action("ipc-export", body)
        self.expires_at = renewed["expires_at"]
        return self.expires_at

    def to_arrow(self):
        """A host copy of every exported column of every partition as a pyarrow Table."""
        self._check_open()
        batches = [
            pa.record_batch([c.to_arrow() for c in p.columns.values()], schema=self.schema)
            for p in self.partitions
        ]
        return pa.Table.from_batches(batches, schema=self.schema)

    def close(self):
        """Unmaps every handle this export opened, then releases the lease. Idempotent."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        try:
            for partition in self.partitions:
                partition._close()
        finally:
            self._release_lease()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
