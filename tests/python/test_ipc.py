"""ipc-export through examples/python/gpu_flight_ipc.py, against the real binary.

On the host backend the export is refused with FAILED_PRECONDITION; with GPU_FLIGHT_BACKEND=cuda
(the GPU machine) this process maps the server's columns and checks them against DoGet.
"""

import importlib
import json
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pytest
from conftest import BACKEND
from test_flight import action, all_types_table, get, put, unique

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples" / "python"
cuda_only = pytest.mark.skipif(BACKEND != "cuda", reason="CUDA IPC needs GPU_FLIGHT_BACKEND=cuda")


def consumer_module():
    sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module("gpu_flight_ipc")


def device_bytes(server):
    return server.status()["counters"]["device_allocated_bytes"]


@pytest.mark.skipif(BACKEND != "host", reason="the host backend's refusal")
def test_host_backend_refuses_export_with_failed_precondition(client):
    name = unique("host")
    put(client, name, pa.table({"x": [1, 2, 3]}))
    with pytest.raises(pa.ArrowInvalid, match="precondition failed error.*host memory.*DoGet"):
        action(client, "ipc-export", {"name": name})
    with pytest.raises(pa.ArrowKeyError, match="not found"):
        action(client, "ipc-export", {"name": unique("absent")})
    assert action(client, "status")["leases"] == []


@cuda_only
def test_every_column_maps_and_equals_do_get(client):
    ipc = consumer_module()
    table = all_types_table(1000)
    name = unique("ipc")
    put(client, name, table, chunk=97)  # many batches, compacted into one allocation per column
    expected = get(client, name)
    with ipc.ExportedDataset(client, name) as exported:
        assert exported.schema.equals(table.schema)
        assert exported.num_rows == table.num_rows
        for field in table.schema:
            column = exported[field.name]
            got = column.to_arrow()
            assert got.equals(expected.column(field.name).combine_chunks()), field.name
            assert column.null_count == expected.column(field.name).null_count, field.name
        assert exported.to_arrow().equals(expected.combine_chunks())


@cuda_only
def test_fixed_width_columns_are_zero_copy_cupy_and_torch_views(client):
    ipc = consumer_module()
    import cupy as cp
    import torch

    n = 1_000_000
    values = np.arange(n, dtype=np.int64) * 3
    mask = np.zeros(n, dtype=bool)
    mask[::7] = True
    table = pa.table({"v": pa.array(values, mask=mask), "f": np.linspace(0, 1, n, dtype=np.float32)})
    name = unique("views")
    put(client, name, table, chunk=100_000)
    with ipc.ExportedDataset(client, name) as exported:
        column = exported["v"]
        view = column.to_cupy()
        assert view.dtype == cp.int64 and view.shape == (n,)
        valid = ~mask
        assert np.array_equal(cp.asnumpy(view)[valid], values[valid])
        tensor = column.to_torch()
        assert tensor.device.type == "cuda" and tensor.data_ptr() == view.data.ptr, "zero-copy"
        assert int(tensor[3].item()) == 9
        bitmap = np.unpackbits(cp.asnumpy(column.validity()), bitorder="little")[:n].astype(bool)
        assert np.array_equal(bitmap, valid)
        floats = exported["f"].to_torch()
        assert torch.allclose(floats.cpu(), torch.from_numpy(table.column("f").to_numpy().copy()))
    put(client, name + "-s", pa.table({"s": ["a", "bc"]}))
    with ipc.ExportedDataset(client, name + "-s") as strings:
        with pytest.raises(TypeError, match="fixed-width"):
            strings["s"].to_cupy()
        assert set(strings["s"].buffers()) == {"offsets", "values"}


@cuda_only
def test_a_handle_opened_twice_in_one_process_and_leases_released(server, client):
    ipc = consumer_module()
    name = unique("twice")
    put(client, name, pa.table({"a": np.arange(10_000), "b": np.arange(10_000) * 2.0}))
    first = ipc.ExportedDataset(client, name)
    second = ipc.ExportedDataset(client, name, columns=["b"])
    assert first.lease != second.lease
    assert np.array_equal(first["b"].to_cupy().get(), second["b"].to_cupy().get())
    first.close()
    assert second["b"].to_cupy().sum().item() == float(np.arange(10_000).sum() * 2)
    second.close()
    assert ipc.MAPPINGS.count() == 0
    assert action(client, "status")["leases"] == []
    with pytest.raises(RuntimeError, match="closed"):
        second["b"]


@cuda_only
def test_released_and_expired_leases_give_memory_back(server, client):
    ipc = consumer_module()
    start = device_bytes(server)
    name = unique("free")
    put(client, name, pa.table({"x": np.arange(2_000_000)}))
    exported = ipc.ExportedDataset(client, name)
    action(client, "drop", {"name": name})
    assert device_bytes(server) > start, "the lease holds the dropped dataset"
    assert exported["x"].to_cupy()[5].item() == 5, "still mapped and readable"
    exported.close()
    assert device_bytes(server) == start

    put(client, name, pa.table({"x": np.arange(2_000_000)}))
    action(client, "ipc-export", {"name": name, "lease_seconds": 1})
    action(client, "drop", {"name": name})
    server.wait_for(lambda: device_bytes(server) == start, timeout=5)
    assert action(client, "status")["leases"] == []


@cuda_only
def test_a_killed_consumer_holds_memory_only_until_its_lease_ends(server, client):
    start = device_bytes(server)
    name = unique("killed")
    put(client, name, pa.table({"x": np.arange(1_000_000)}))
    script = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(EXAMPLES)!r})
        import pyarrow.flight as flight
        from gpu_flight_ipc import ExportedDataset
        exported = ExportedDataset(flight.connect({server.location!r}), {name!r}, lease_seconds=2)
        print(int(exported["x"].to_cupy()[7].item()), flush=True)
        time.sleep(600)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "7"
    finally:
        child.kill()
        child.wait()
    action(client, "drop", {"name": name})
    server.wait_for(lambda: device_bytes(server) == start, timeout=10)
    assert action(client, "status")["leases"] == []


@cuda_only
def test_another_node_is_told_to_use_do_get(client, monkeypatch):
    ipc = consumer_module()
    name = unique("remote")
    put(client, name, pa.table({"x": [1, 2]}))
    monkeypatch.setattr(ipc, "find_device", lambda uuid, pci: None)
    with pytest.raises(ipc.DeviceNotVisible, match="cannot see.*DoGet"):
        ipc.ExportedDataset(client, name)
    assert action(client, "status")["leases"] == [], "the lease was released"
    assert json.dumps(get(client, name).to_pydict()) == json.dumps({"x": [1, 2]})
    with pytest.raises(pa.ArrowKeyError):
        action(client, "ipc-release", {"lease": "0" * 32})


@cuda_only
def test_a_consumer_names_its_device_and_gets_every_partition(client):
    ipc = consumer_module()
    name = unique("ondevice")
    n = 100_000
    table = pa.table({"x": np.arange(n), "s": [str(i) for i in range(n)]})
    put(client, name, table, chunk=10_000)
    expected = get(client, name)
    for copy in (False, True):
        with ipc.ExportedDataset(client, name, device=0, copy=copy) as exported:
            assert exported.document["version"] == 2
            assert exported.document["consumer_device"]["uuid"] == ipc.device_uuid(0)
            assert [p.access for p in exported.partitions] == ["local"], "one GPU holds it all"
            assert exported.to_arrow().equals(expected)
    assert action(client, "status")["leases"] == []
    with pytest.raises(ValueError, match="device="):
        ipc.ExportedDataset(client, name, copy=True)


@cuda_only
def test_a_dataset_spread_over_two_gpus_maps_from_either(make_server):
    """Every partition maps where it lies, for peer access from the consumer's GPU, or as a
    replica on it; all three read back equal to DoGet. Runs where the node has two GPUs."""
    ipc = consumer_module()
    import cupy as cp

    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    server = make_server("--devices", "0,1", "--memory-limit", "48MB", "--host-memory-limit", "0")
    client = server.client()
    name = unique("spread")
    n = 8_000_000  # 64 MB of int64: more than one GPU's limit
    put(client, name, pa.table({"x": np.arange(n)}), chunk=500_000)
    expected = get(client, name)
    placed = {d["device"]: d["uuid"] for d in server.status()["devices"]}
    with ipc.ExportedDataset(client, name) as exported:
        servers = [p.server_device for p in exported.partitions]
        assert sorted(set(servers)) == [0, 1], servers
        assert {p.access for p in exported.partitions} == {"local"}
        assert [ipc.device_uuid(p.device) for p in exported.partitions] == [placed[d] for d in servers]
        assert exported.to_arrow().equals(expected)
        with pytest.raises(ValueError, match="partitions"):
            exported["x"]
    with ipc.ExportedDataset(client, name, device=0) as exported:
        assert [p.access for p in exported.partitions] == ["local" if d == 0 else "peer" for d in servers]
        assert {p.device for p in exported.partitions} == {0}, "all mapped on the consumer's GPU"
        assert exported.to_arrow().equals(expected)
    before = [d["used_bytes"] for d in server.status()["devices"]]
    with pytest.raises(pa.ArrowException, match="out of memory|memory limit"):
        ipc.ExportedDataset(client, name, device=1, copy=True)  # the replicas do not fit beside
    assert [d["used_bytes"] for d in server.status()["devices"]] == before
    action(client, "drop", {"name": name})
    subset = unique("spread-small")
    put(client, subset, pa.table({"x": np.arange(1_000_000)}))
    action(client, "move", {"name": subset, "device": 0})
    before = [d["used_bytes"] for d in server.status()["devices"]]
    with ipc.ExportedDataset(client, subset, device=1, copy=True) as exported:
        assert [p.access for p in exported.partitions] == ["replica"]
        assert exported.partitions[0].device == 1
        leases = server.status()["leases"]
        assert leases[0]["replica_bytes"] >= 8_000_000, leases
        assert exported.to_arrow().equals(get(client, subset))
    assert server.status()["leases"] == []
    assert [d["used_bytes"] for d in server.status()["devices"]] == before
