"""Placement across devices, through the real binary: on the host backend split into pretend
devices (`--host-devices`), each with `--memory-limit` of its own, as CI has no GPUs.

A dataset larger than one device is spread across them; GetFlightInfo's endpoints each lie on
one device and say which in their app_metadata; a put may name its device.
"""

import json

import pyarrow as pa
import pyarrow.flight as flight
import pytest
from conftest import BACKEND
from test_flight import get, unique

host_only = pytest.mark.skipif(BACKEND != "host", reason="pretend devices are a host-backend feature")

# 1.12 MB of int64 a batch: above what the host backend concatenates at commit, and small
# beside a device, since the messages being received are charged too while they arrive.
ROWS = 140_000


def table(batches):
    return pa.table({"x": pa.array(range(batches * ROWS), pa.int64())})


def put_on(client, name, data, device=None):
    command = {"name": name} if device is None else {"name": name, "device": device}
    writer, reader = client.do_put(flight.FlightDescriptor.for_command(json.dumps(command)), data.schema)
    writer.write_table(data, max_chunksize=ROWS)
    writer.done_writing()
    reader.read()
    writer.close()


def endpoint_devices(client, name):
    info = client.get_flight_info(flight.FlightDescriptor.for_path(name))
    return [json.loads(endpoint.app_metadata)["device"] for endpoint in info.endpoints]


@host_only
def test_a_dataset_larger_than_a_device_is_spread_and_read_back(make_server):
    server = make_server("--host-devices", "2", "--memory-limit", "12MB", "--rows-per-endpoint", "500000")
    data = table(12)  # 13.4 MB: more than one device holds
    name = unique()
    with server.client() as client:
        put_on(client, name, data)
        assert get(client, name).equals(data)
        devices = endpoint_devices(client, name)
        assert sorted(set(devices)) == [0, 1], devices
        runs = [d for i, d in enumerate(devices) if i == 0 or devices[i - 1] != d]
        assert len(runs) == 2, f"each device's rows are one run: {devices}"
    status = server.status()
    assert [d["device"] for d in status["devices"]] == [0, 1]
    assert status["topology"]["peer_access"] == [[True, True], [True, True]], "one host memory"
    assert all(d["used_bytes"] > 0 for d in status["devices"]), status["devices"]


@host_only
def test_a_put_may_name_its_device(make_server):
    server = make_server("--host-devices", "3", "--memory-limit", "3MB")
    name = unique()
    with server.client() as client:
        put_on(client, name, table(1), device=2)
        assert set(endpoint_devices(client, name)) == {2}
        with pytest.raises(pa.ArrowInvalid, match="there is no device 7"):
            put_on(client, unique(), table(1), device=7)
        with pytest.raises(pa.ArrowInvalid, match="no device of this server has the UUID"):
            put_on(client, unique(), table(1), device="GPU-00000000-0000-0000-0000-000000000000")
        with pytest.raises(pa.ArrowInvalid, match="memory limit reached on device 1"):
            put_on(client, unique(), table(3), device=1)  # 3.4 MB on a 3 MB device
        assert get(client, name).equals(table(1))


def test_endpoints_name_the_device_their_rows_are_on(client, server):
    name = unique()
    put_on(client, name, table(1))
    assert endpoint_devices(client, name) == [0]
    long = "GPU-" + "f" * 5000
    with pytest.raises(pa.ArrowInvalid, match="a device is a number or a GPU UUID") as refused:
        put_on(client, unique(), table(1), device=long)
    assert long not in str(refused.value), "a long string is not echoed back"
    status = server.status()
    devices = status["devices"]
    assert len(status["topology"]["peer_access"]) == len(devices)
    if BACKEND == "cuda":  # a GPU can be named by its UUID too
        other = unique()
        put_on(client, other, table(1), device=devices[0]["uuid"])
        assert endpoint_devices(client, other) == [0]


@host_only
def test_the_move_action_moves_a_dataset_whole(make_server):
    server = make_server("--host-devices", "2", "--memory-limit", "12MB")
    name = unique()
    data = table(4)
    with server.client() as client:
        put_on(client, name, data, device=0)
        [result] = client.do_action(flight.Action("move", json.dumps({"name": name, "device": 1}).encode()))
        moved = json.loads(result.body.to_pybytes())
        assert (moved["name"], moved["device"], moved["moved_bytes"]) == (name, 1, data.nbytes)
        assert set(endpoint_devices(client, name)) == {1}
        assert get(client, name).equals(data)
        with pytest.raises(pa.ArrowInvalid, match="there is no device 3"):
            list(client.do_action(flight.Action("move", json.dumps({"name": name, "device": 3}).encode())))
    assert server.status()["devices"][0]["used_bytes"] < 10_000, "device 0 holds no rows"


@host_only
def test_the_copy_action_copies_a_dataset_to_a_new_name_on_a_device(make_server):
    server = make_server("--host-devices", "2", "--memory-limit", "12MB")
    name, copy = unique(), unique()
    data = table(6)  # 6.7 MB: a device holds one copy, not two

    def copy_action(client, body):
        [result] = client.do_action(flight.Action("copy", json.dumps(body).encode()))
        return json.loads(result.body.to_pybytes())

    with server.client() as client:
        put_on(client, name, data, device=0)
        copied = copy_action(client, {"name": name, "as": copy, "device": 1})
        assert (copied["name"], copied["as"], copied["device"], copied["copied_bytes"]) == (name, copy, 1, data.nbytes)
        assert set(endpoint_devices(client, copy)) == {1}
        assert set(endpoint_devices(client, name)) == {0}
        assert get(client, copy).equals(data)
        with pytest.raises(pa.ArrowException, match="already exists"):
            copy_action(client, {"name": name, "as": copy, "device": 1})
        with pytest.raises(pa.ArrowInvalid, match="copy takes a JSON object"):
            copy_action(client, {"name": name, "device": 1})
        used = [d["used_bytes"] for d in server.status()["devices"]]
        with pytest.raises(pa.ArrowException, match="memory limit reached on device 1"):
            copy_action(client, {"name": copy, "as": unique(), "device": 1})
        assert [d["used_bytes"] for d in server.status()["devices"]] == used
