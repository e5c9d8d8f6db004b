"""`Client.put_device` (ipc-import) against the real binary.

Everywhere: the documents the package builds (here over host memory described through the C
data interface, with made-up handles) pass every check of the server's that needs no device,
and the host backend then refuses them with FAILED_PRECONDITION, committing nothing. With
GPU_FLIGHT_BACKEND=cuda (the GPU machine, CuPy installed): CuPy, PyTorch, cuDF and Arrow
device data are handed over and read back with DoGet; memory from a stream-ordered pool is
refused before anything is sent; the producer's memory may be freed once the call returns.
"""

import ctypes
import gc

import gpu_flight
import numpy as np
import pyarrow as pa
import pytest
from gpu_flight import _cdata, _import

from conftest import BACKEND
from test_flight import all_types_table, unique

cuda_only = pytest.mark.skipif(BACKEND != "cuda", reason="ipc-import needs GPU_FLIGHT_BACKEND=cuda")


@pytest.fixture
def gf(server):
    with gpu_flight.connect(server.location) as client:
        yield client


def host_document(name, batch, mode="create"):
    """The import document of `batch`, in host memory, as `put_device` builds it: every
    buffer in an allocation of its own, named by a made-up handle."""
    array = _cdata.ArrowArray()
    schema = ctypes.create_string_buffer(72)
    batch._export_to_c(ctypes.addressof(array), ctypes.addressof(schema))
    handles = {}

    def find(pointer, _ordinal):
        handle = handles.setdefault(pointer, len(handles).to_bytes(2, "little") * 32)
        return handle, pointer, 1 << 40

    def read_offset(pointer, index, width, _ordinal):
        return int.from_bytes(ctypes.string_at(pointer + index * width, width), "little", signed=True)

    device = {"ordinal": 0, "uuid": "GPU-00000000-0000-0000-0000-000000000000", "pci_bus_id": "0000:00:00.0"}
    try:
        return _import.import_document(name, mode, batch.schema, array, 0, device, find, read_offset)
    finally:
        array.release(ctypes.pointer(array))
        pa.Schema._import_from_c(ctypes.addressof(schema))  # releases it


@pytest.mark.skipif(BACKEND != "host", reason="the host backend's refusal")
def test_documents_of_every_type_pass_the_servers_checks_then_the_host_backend_refuses(server, gf):
    table = all_types_table(300)
    ints = pa.table({"x": pa.array([None if i % 5 == 0 else i for i in range(100)], pa.int64())})
    for batch in [*table.to_batches(), ints.slice(8, 50).to_batches()[0]]:
        document = host_document(unique("imported"), batch)
        with pytest.raises(pa.ArrowException, match=r"(?i)precondition.*cuda backend"):
            gf._action("ipc-import", document)
    # Slices the layout cannot take as they are (a bitmap from mid-byte, offsets not from 0)
    # are refused before anything is sent.
    with pytest.raises(NotImplementedError, match="a copy"):
        host_document(unique("sliced"), table.slice(7, 100).combine_chunks().to_batches()[0])
    # A forged number is refused by the checks first, with INVALID_ARGUMENT.
    document = host_document(unique("forged"), pa.record_batch({"x": np.arange(10, dtype=np.int64)}))
    document["columns"][0]["buffers"][0]["length"] = 79
    with pytest.raises(pa.ArrowInvalid, match="need 80"):
        gf._action("ipc-import", document)
    assert not [n for n in gf.list() if "imported" in n or "forged" in n], "nothing committed"


def test_put_device_refuses_what_it_cannot_hand_over(gf):
    with pytest.raises(TypeError, match="put_device takes"):
        gf.put_device(unique("x"), [1, 2, 3])
    with pytest.raises(TypeError, match="put_device takes"):
        gf.put_device(unique("x"), pa.table({"x": [1]}))  # host memory: use put


class FakeCudaArray:
    """An empty column in the CUDA array interface (no device memory: a null pointer)."""

    def __init__(self, typestr: str, rows: int = 0) -> None:
        self.__cuda_array_interface__ = {
            "shape": (rows,),
            "typestr": typestr,
            "data": (0, True),
            "version": 3,
        }


def test_cuda_array_columns_take_the_arrow_type_of_their_typestr():
    columns = {
        name: FakeCudaArray(typestr)
        for name, typestr in [
            ("a", "<i1"),
            ("b", "<i8"),
            ("c", "<u2"),
            ("d", "<f4"),
            ("e", "<f8"),
            ("f", "|u1"),
        ]
    }
    schema, _, _ = _import._columns(columns)
    assert schema.types == [pa.int8(), pa.int64(), pa.uint16(), pa.float32(), pa.float64(), pa.uint8()]
    for typestr in [">i8", "<c8", "<i16", "<M8"]:
        with pytest.raises(TypeError, match="unsupported type"):
            _import._columns({"x": FakeCudaArray(typestr)})


cupy = pytest.importorskip("cupy") if BACKEND == "cuda" else None


@cuda_only
def test_cupy_columns_are_copied_device_to_device(server, gf):
    name = unique("cupy")
    rows = 1 << 20
    columns = {f"c{i}": cupy.arange(rows, dtype=cupy.int64) * (i + 1) for i in range(8)}
    columns["f"] = cupy.linspace(0, 1, rows, dtype=cupy.float32)
    result = gf.put_device(name, columns)
    assert result.rows == rows
    del columns  # the server holds its own copy
    gc.collect()
    cupy.get_default_memory_pool().free_all_blocks()
    table = gf.get(name)
    assert table.num_rows == rows
    assert table["c3"].to_numpy().tolist()[:4] == [0, 4, 8, 12]
    assert table["f"].type == pa.float32()
    appended = gf.put_device(
        name,
        {
            k: cupy.ones(5, dtype=v)
            for k, v in [*((f"c{i}", cupy.int64) for i in range(8)), ("f", cupy.float32)]
        },
        mode="append",
    )
    assert appended.total_rows == rows + 5
    replaced = gf.put_device(
        name,
        {
            **{f"c{i}": cupy.zeros(3, dtype=cupy.int64) for i in range(8)},
            "f": cupy.zeros(3, dtype=cupy.float32),
        },
        mode="replace",
    )
    assert replaced.total_rows == 3
    with pytest.raises(pa.ArrowException, match=r"(?i)already exists"):
        gf.put_device(name, {"c0": cupy.zeros(3, dtype=cupy.int64)})


@cuda_only
def test_pool_memory_is_refused_with_a_clear_error(gf):
    pool = cupy.cuda.MemoryAsyncPool()
    with cupy.cuda.using_allocator(pool.malloc):
        column = cupy.arange(1000, dtype=cupy.int64)
    with pytest.raises(gpu_flight.NotShareable, match="cudaMallocAsync"):
        gf.put_device(unique("pool"), {"x": column})


@cuda_only
def test_torch_tensors_are_handed_over(gf):
    torch = pytest.importorskip("torch")
    name = unique("torch")
    x = torch.arange(10_000, dtype=torch.int32, device="cuda")
    gf.put_device(name, {"x": x, "y": x.double() / 2})
    table = gf.get(name)
    assert table["x"].to_pylist()[:3] == [0, 1, 2]
    assert table["y"].to_pylist()[3] == 1.5


@cuda_only
def test_cudf_frames_with_nulls_and_strings_are_handed_over(gf):
    cudf = pytest.importorskip("cudf")
    name = unique("cudf")
    frame = cudf.DataFrame({"i": [1, None, 3], "s": ["a", None, "ccc"]})
    if not hasattr(frame, "__arrow_c_device_array__"):
        pytest.skip("this cuDF has no Arrow device interface (strings and nulls need it)")
    gf.put_device(name, frame)
    assert gf.get(name).to_pydict() == {"i": [1, None, 3], "s": ["a", None, "ccc"]}
