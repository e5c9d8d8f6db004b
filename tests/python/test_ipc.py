"""`Client.export` (ipc-export) against the real binary.

On the host backend the export is refused with FAILED_PRECONDITION; with GPU_FLIGHT_BACKEND=cuda
(the GPU machine) this process maps the server's columns, and CuPy and PyTorch read them
through the Arrow device structs, `__cuda_array_interface__` and DLPack, against DoGet.
"""

import ctypes
import gc
import subprocess
import sys

import gpu_flight
import numpy as np
import pyarrow as pa
import pytest
from gpu_flight import _cdata, _cuda

from conftest import BACKEND
from test_flight import action, all_types_table, get, put, unique

cuda_only = pytest.mark.skipif(BACKEND != "cuda", reason="CUDA IPC needs GPU_FLIGHT_BACKEND=cuda")


def device_bytes(server):
    return server.status()["counters"]["device_allocated_bytes"]


def leases(server):
    return server.status()["leases"]


def settle(server):
    """Waits for every lease to end: the last view's release ends its lease on the package's
    lease thread, just after the garbage collector ran."""
    gc.collect()
    server.wait_for(lambda: leases(server) == [], timeout=10)


@pytest.fixture
def gf(server):
    with gpu_flight.connect(server.location) as client:
        yield client


@pytest.mark.skipif(BACKEND != "host", reason="the host backend's refusal")
def test_host_backend_refuses_export_with_failed_precondition(server, gf):
    name = unique("host")
    gf.put(name, pa.table({"x": [1, 2, 3]}))
    with pytest.raises(pa.ArrowInvalid, match=r"precondition failed error.*host memory.*DoGet"):
        gf.export(name)
    with pytest.raises(pa.ArrowKeyError, match="not found"):
        gf.export(unique("absent"))
    with pytest.raises(TypeError, match="string"):
        gf.export(name, columns="x")
    with pytest.raises(ValueError, match="device="):
        gf.export(name, copy=True)
    assert leases(server) == []


# Reading what the Arrow device structs describe, independently of the producer: sizes from the
# types and lengths alone, every buffer copied to the host with CuPy.


def device_bytes_at(pointer, nbytes):
    import cupy as cp

    if nbytes == 0:
        return pa.py_buffer(b"")
    memory = cp.cuda.UnownedMemory(pointer, nbytes, None)
    view = cp.ndarray((nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(memory, 0))
    return pa.py_buffer(view.get().tobytes())


def read_device_array(array, data_type):
    """A host copy of the ArrowArray `array` of `data_type`, on the current CUDA device."""
    n = array.length
    assert array.offset == 0
    pointers = [array.buffers[i] for i in range(array.n_buffers)]
    bitmap = (n + 7) // 8

    def fetch(index, nbytes):
        return None if not pointers[index] else device_bytes_at(pointers[index], nbytes)

    if pa.types.is_null(data_type):
        assert array.n_buffers == 0
        return pa.nulls(n)
    buffers = [fetch(0, bitmap)]
    children = []
    if pa.types.is_dictionary(data_type):
        buffers.append(fetch(1, n * data_type.index_type.bit_width // 8))
        indices = pa.Array.from_buffers(data_type.index_type, n, buffers, array.null_count)
        dictionary = read_device_array(array.dictionary.contents, data_type.value_type)
        return pa.DictionaryArray.from_arrays(indices, dictionary)
    if pa.types.is_boolean(data_type):
        buffers.append(fetch(1, bitmap))
    elif pa.types.is_string(data_type) or pa.types.is_binary(data_type):
        offsets = fetch(1, (n + 1) * 4)
        buffers += [offsets, fetch(2, int(np.frombuffer(offsets, np.int32)[n]))]
    elif pa.types.is_large_string(data_type) or pa.types.is_large_binary(data_type):
        offsets = fetch(1, (n + 1) * 8)
        buffers += [offsets, fetch(2, int(np.frombuffer(offsets, np.int64)[n]))]
    elif pa.types.is_list(data_type) or pa.types.is_map(data_type):
        buffers.append(fetch(1, (n + 1) * 4))
    elif pa.types.is_large_list(data_type):
        buffers.append(fetch(1, (n + 1) * 8))
    elif pa.types.is_struct(data_type) or pa.types.is_fixed_size_list(data_type):
        pass
    else:
        buffers.append(fetch(1, n * data_type.bit_width // 8))
    assert len(pointers) == len(buffers), (data_type, len(pointers))
    types = (
        [pa.struct([data_type.key_field, data_type.item_field])]
        if pa.types.is_map(data_type)
        else [data_type.field(i).type for i in range(data_type.num_fields)]
    )
    assert array.n_children == len(types)
    children = [read_device_array(array.children[i].contents, t) for i, t in enumerate(types)]
    return pa.Array.from_buffers(data_type, n, buffers, array.null_count, children=children)


def read_device_batch(device_array, schema):
    import cupy as cp

    assert device_array.device_type == _cdata.ARROW_DEVICE_CUDA
    assert device_array.sync_event, "a CUDA event to wait on"
    event = ctypes.c_void_p.from_address(device_array.sync_event).value
    with cp.cuda.Device(device_array.device_id):
        cp.cuda.runtime.eventSynchronize(event)
        top = device_array.array
        assert top.n_children == len(schema) and top.n_buffers == 1 and not top.buffers[0]
        columns = [read_device_array(top.children[i].contents, f.type) for i, f in enumerate(schema)]
    return pa.record_batch(columns, schema=schema)


@cuda_only
def test_every_type_through_the_arrow_device_array_equals_do_get(server, client, gf):
    table = all_types_table(1000)
    name = unique("capsule")
    put(client, name, table, chunk=97)  # many batches, compacted into one allocation per column
    expected = get(client, name)
    with gf.export(name) as exported:
        assert exported.schema.equals(table.schema)
        assert exported.num_rows == table.num_rows
        schema_capsule, array_capsule = exported.__arrow_c_device_array__()
        assert pa.Schema._import_from_c_capsule(schema_capsule).equals(table.schema)
        pointer = _cdata.capsule_pointer(array_capsule, b"arrow_device_array")
        device_array = ctypes.cast(pointer, ctypes.POINTER(_cdata.ArrowDeviceArray)).contents
        assert device_array.device_id == exported.partitions[0].device
        got = read_device_batch(device_array, table.schema)
        for field in table.schema:
            assert got.column(field.name).equals(expected.column(field.name).combine_chunks()), field.name
        assert exported.to_arrow().equals(expected.combine_chunks())
        del schema_capsule, array_capsule, device_array
    settle(server)


@cuda_only
def test_the_device_stream_gives_every_partition_in_order(server, gf):
    n = 200_000
    table = pa.table({"x": np.arange(n), "s": [str(i) for i in range(n)]})
    name = unique("stream")
    gf.put(name, table)
    for i in range(3):  # each append is a partition of its own
        gf.put(name, table.slice(i * 1000, 1000), mode="append")
    expected = gf.get(name)
    with gf.export(name) as exported:
        assert len(exported.partitions) > 1
        with pytest.raises(ValueError, match="partitions"):
            exported.__arrow_c_device_array__()
        capsule = exported.__arrow_c_device_stream__()
        stream = ctypes.cast(
            _cdata.capsule_pointer(capsule, b"arrow_device_array_stream"),
            ctypes.POINTER(_cdata.ArrowDeviceArrayStream),
        )
        assert stream.contents.device_type == _cdata.ARROW_DEVICE_CUDA
        batches = []
        while True:
            out = _cdata.ArrowDeviceArray()
            assert stream.contents.get_next(stream, ctypes.byref(out)) == 0
            if not out.array.release:
                break
            batches.append(read_device_batch(out, exported.schema))
            out.array.release(ctypes.pointer(out.array))
        assert [b.num_rows for b in batches] == [p.num_rows for p in exported.partitions]
        assert pa.Table.from_batches(batches).equals(expected.combine_chunks())
        stream.contents.release(stream)
        del capsule
    settle(server)


@cuda_only
def test_fixed_width_columns_are_zero_copy_cupy_and_torch_views(server, gf):
    import cupy as cp
    import torch

    n = 1_000_000
    values = np.arange(n, dtype=np.int64) * 3
    mask = np.zeros(n, dtype=bool)
    mask[::7] = True
    table = pa.table({"v": pa.array(values, mask=mask), "f": np.linspace(0, 1, n, dtype=np.float32)})
    name = unique("views")
    gf.put(name, table)
    with gf.export(name) as exported:
        column = exported["v"]
        view = cp.asarray(column)
        assert view.dtype == cp.int64 and view.shape == (n,)
        assert view.data.ptr == column.buffers()["values"][0], "zero-copy"
        valid = ~mask
        assert np.array_equal(cp.asnumpy(view)[valid], values[valid])
        tensor = torch.from_dlpack(column)
        assert tensor.device == torch.device("cuda", column.device)
        assert tensor.data_ptr() == view.data.ptr, "zero-copy"
        assert int(tensor[3].item()) == 9
        bitmap = np.unpackbits(cp.asnumpy(cp.asarray(column.validity)), bitorder="little")[:n].astype(bool)
        assert np.array_equal(bitmap, valid)
        floats = torch.from_dlpack(exported["f"])
        assert torch.equal(floats.cpu(), torch.from_numpy(table.column("f").to_numpy().copy()))
        assert exported["f"].validity is None
        del view, tensor, floats
    gf.put(name + "-s", pa.table({"s": ["a", "bc"], "b": [True, False]}))
    with gf.export(name + "-s") as strings:
        for column in ("s", "b"):
            with pytest.raises(TypeError, match="fixed-width"):
                cp.asarray(strings[column])
        assert set(strings["s"].buffers()) == {"offsets", "values"}
        assert strings["s"].to_arrow().to_pylist() == ["a", "bc"]
    settle(server)


@cuda_only
def test_views_keep_the_memory_until_they_are_dropped(server, gf):
    import cupy as cp
    import torch

    name = unique("lifetime")
    gf.put(name, pa.table({"a": np.arange(10_000), "b": np.arange(10_000) * 2.0}))
    first = gf.export(name)
    second = gf.export(name, columns=["b"])
    assert first.lease != second.lease
    handles = {c["handle"] for p in first.document["partitions"] for c in p["columns"]}
    assert _cuda.MAPPINGS.count() == len(handles), "each allocation opened once for both"
    view = cp.asarray(first["b"])
    tensor = torch.from_dlpack(second["b"])
    first.close()
    second.close()
    assert first.closed and not first.released, "the CuPy view holds the first lease"
    with pytest.raises(RuntimeError, match="closed"):
        first["b"]
    assert len(leases(server)) == 2
    before = second.expires_at
    assert second.renew(900) > before, "renewed after close(): the tensor still uses it"
    assert view.sum().item() == float(np.arange(10_000).sum() * 2)
    del view
    gc.collect()
    assert first.released
    server.wait_for(lambda: len(leases(server)) == 1, timeout=10)
    assert tensor.sum().item() == float(np.arange(10_000).sum() * 2)
    del tensor
    settle(server)
    assert second.released and _cuda.MAPPINGS.count() == 0
    with pytest.raises(RuntimeError, match="released"):
        second.renew()

    forgotten = gf.export(name)
    assert len(leases(server)) == 1
    del forgotten  # never closed: collected
    settle(server)


@cuda_only
def test_released_and_expired_leases_give_memory_back(server, client, gf):
    import cupy as cp

    start = device_bytes(server)
    name = unique("free")
    gf.put(name, pa.table({"x": np.arange(2_000_000)}))
    exported = gf.export(name)
    gf.drop(name)
    assert device_bytes(server) > start, "the lease holds the dropped dataset"
    assert cp.asarray(exported["x"])[5].item() == 5, "still mapped and readable"
    exported.close()
    assert device_bytes(server) == start, "closed with nothing taken: released at once"

    gf.put(name, pa.table({"x": np.arange(2_000_000)}))
    action(client, "ipc-export", {"name": name, "lease_seconds": 1})
    gf.drop(name)
    server.wait_for(lambda: device_bytes(server) == start, timeout=5)
    assert leases(server) == []


CONSUMER = """
import os, sys, time
import gpu_flight, torch
client = gpu_flight.connect({location!r})
exported = client.export({name!r}, lease_seconds={lease})
tensor = torch.from_dlpack(exported["x"])
print(int(tensor[7].item()), flush=True)
{end}
"""


@cuda_only
def test_a_consumer_that_exits_releases_its_lease_at_exit(server, gf):
    name = unique("exits")
    gf.put(name, pa.table({"x": np.arange(1_000_000)}))
    # It exits holding a view, without closing: the lease (600 s) is released at exit.
    script = CONSUMER.format(location=server.location, name=name, lease=600, end="sys.exit(0)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "7"
    assert leases(server) == []


@cuda_only
def test_a_killed_consumer_holds_memory_only_until_its_lease_ends(server, gf):
    start = device_bytes(server)
    name = unique("killed")
    gf.put(name, pa.table({"x": np.arange(1_000_000)}))
    script = CONSUMER.format(location=server.location, name=name, lease=2, end="time.sleep(600)")
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "7"
    finally:
        child.kill()
        child.wait()
    assert len(leases(server)) == 1
    gf.drop(name)
    server.wait_for(lambda: device_bytes(server) == start, timeout=10)
    assert leases(server) == []


@cuda_only
def test_another_node_is_told_to_use_do_get(server, gf, monkeypatch):
    name = unique("remote")
    gf.put(name, pa.table({"x": [1, 2]}))
    monkeypatch.setattr(_cuda, "find_device", lambda uuid, pci: None)
    with pytest.raises(gpu_flight.DeviceNotVisible, match=r"cannot see.*Client\.get"):
        gf.export(name)
    assert leases(server) == [], "the lease was released"
    assert gf.get(name).to_pydict() == {"x": [1, 2]}


@cuda_only
def test_a_consumer_names_its_device_and_gets_every_partition(server, client, gf):
    name = unique("ondevice")
    n = 100_000
    table = pa.table({"x": np.arange(n), "s": [str(i) for i in range(n)]})
    put(client, name, table, chunk=10_000)
    expected = gf.get(name)
    for copy in (False, True):
        with gf.export(name, device=0, copy=copy) as exported:
            assert exported.document["consumer_device"]["uuid"] == _cuda.uuid(0)
            assert [p.access for p in exported.partitions] == ["local"], "one GPU holds it all"
            assert exported.to_arrow().equals(expected)
    with gf.export(name, device=_cuda.uuid(0)) as exported:
        assert exported.partitions[0].device == 0
    settle(server)


@cuda_only
def test_to_cudf_takes_every_column_cudf_can_hold(server, gf):
    cudf = pytest.importorskip("cudf", reason="cuDF is not installed here (its wheels are not carried)")
    from gpu_flight import _cudf

    table = all_types_table(1000)
    held = [f.name for f in table.schema if f.name not in {"f16", "binary", "large_binary", "fixed_binary"}]
    held = [n for n in held if n not in {"time32", "time64", "decimal256", "fixed_list", "map"}]
    name = unique("cudf")
    gf.put(name, table.select(held))
    with gf.export(name) as exported:
        frame = exported.to_cudf()
        assert isinstance(frame, cudf.DataFrame)
        assert list(frame.columns) == held
        got = frame.to_arrow()
        for column in held:
            assert got.column(column).null_count == table.column(column).null_count, column
            if _cudf.route(table.schema.field(column).type)[0] == _cudf.VIEW and "decimal" not in column:
                assert got.column(column).to_pylist() == table.column(column).to_pylist(), column
        del frame, got
    settle(server)


@cuda_only
def test_a_dataset_spread_over_two_gpus_maps_from_either(make_server):
    """Every partition maps where it lies, for peer access from the consumer's GPU, or as a
    replica on it; all three read back equal to DoGet. Runs where the node has two GPUs."""
    if _cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    server = make_server("--devices", "0,1", "--memory-limit", "48MB", "--host-memory-limit", "0")
    gf = gpu_flight.connect(server.location)
    name = unique("spread")
    n = 8_000_000  # 64 MB of int64: more than one GPU's limit
    put(gf.flight_client, name, pa.table({"x": np.arange(n)}), chunk=500_000)
    expected = gf.get(name)
    placed = {d["device"]: d["uuid"] for d in server.status()["devices"]}
    with gf.export(name) as exported:
        servers = [p.server_device for p in exported.partitions]
        assert sorted(set(servers)) == [0, 1], servers
        assert {p.access for p in exported.partitions} == {"local"}
        assert [_cuda.uuid(p.device) for p in exported.partitions] == [placed[d] for d in servers]
        assert exported.to_arrow().equals(expected)
        with pytest.raises(ValueError, match="partitions"):
            exported["x"]
    with gf.export(name, device=0) as exported:
        assert [p.access for p in exported.partitions] == ["local" if d == 0 else "peer" for d in servers]
        assert {p.device for p in exported.partitions} == {0}, "all mapped on the consumer's GPU"
        assert exported.to_arrow().equals(expected)
    before = [d["used_bytes"] for d in server.status()["devices"]]
    with pytest.raises(pa.ArrowException, match=r"out of memory|memory limit"):
        gf.export(name, device=1, copy=True)  # the replicas do not fit beside
    assert [d["used_bytes"] for d in server.status()["devices"]] == before
    gf.drop(name)
    subset = unique("spread-small")
    gf.put(subset, pa.table({"x": np.arange(1_000_000)}))
    gf.move(subset, 0)
    before = [d["used_bytes"] for d in server.status()["devices"]]
    with gf.export(subset, device=1, copy=True) as exported:
        assert [p.access for p in exported.partitions] == ["replica"]
        assert exported.partitions[0].device == 1
        assert server.status()["leases"][0]["replica_bytes"] >= 8_000_000
        assert exported.to_arrow().equals(gf.get(subset))
    settle(server)
    assert [d["used_bytes"] for d in server.status()["devices"]] == before
