"""gpu-flight's Python client: datasets in GPU (or host) memory over Arrow Flight.

    import gpu_flight

    with gpu_flight.connect("grpc://127.0.0.1:8815") as client:
        client.put("weather", table, mode="replace")
        temps = client.get("weather", columns=["temp"])

Pure Python over pyarrow; `gpu_flight.dask` (extra `dask`) reads and writes Dask DataFrames.
On the server's node, `client.export(name)` (extra `cuda`) maps a dataset's GPU memory into
this process without copying it, for cuDF, CuPy, PyTorch and any consumer of the Arrow device
interface:

    with client.export("weather") as weather:
        frame = weather.to_cudf()                 # cuDF, zero-copy where its layout allows
        temps = cupy.asarray(weather["temp"])     # a CuPy view of the server's memory

and `client.put_device(name, frame)` hands GPU data (cuDF, CuPy, PyTorch, the Arrow device
interface) to the server the other way, device to device.

Errors are pyarrow's own, carrying the server's message (and the gRPC code's name):
NOT_FOUND is `pyarrow.ArrowKeyError`, INVALID_ARGUMENT `pyarrow.ArrowInvalid`, UNIMPLEMENTED
`pyarrow.ArrowNotImplementedError`, UNAUTHENTICATED `pyarrow.flight.FlightUnauthenticatedError`,
PERMISSION_DENIED `pyarrow.flight.FlightUnauthorizedError`, UNAVAILABLE
`pyarrow.flight.FlightUnavailableError`, DEADLINE_EXCEEDED `pyarrow.flight.FlightTimedOutError`;
the other codes (ALREADY_EXISTS, RESOURCE_EXHAUSTED, FAILED_PRECONDITION, ...) are raised as
pyarrow maps them, every one a `pyarrow.ArrowException` whose text holds the code and message.

A process that reads many GB should call `gpu_flight.keep_freed_memory()` first: glibc's
allocator then keeps the memory of each received message for the next instead of handing it
back to the kernel (see its docs for what that costs).
"""

from ._client import Client, Compression, Mode, PutData, connect
from ._cluster import Cluster, connect_all
from ._cuda import CudaError
from ._documents import CopyResult, Device, DropResult, MoveResult, PutResult
from ._export import Bitmap, Column, DeviceNotVisible, Export, Partition, device_uuid
from ._import import NotShareable
from ._memory import keep_freed_memory

__all__ = [
    "Bitmap",
    "Client",
    "Cluster",
    "Column",
    "Compression",
    "CopyResult",
    "CudaError",
    "Device",
    "DeviceNotVisible",
    "DropResult",
    "Export",
    "Mode",
    "MoveResult",
    "NotShareable",
    "Partition",
    "PutData",
    "PutResult",
    "connect",
    "connect_all",
    "device_uuid",
    "keep_freed_memory",
]
__version__ = "0.1.0"
