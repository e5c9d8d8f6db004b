"""`Client.read_shared` (shm-read) against the real binary: the rows DoGet reads, mapped from the
server's shared memory without a copy, its lease released once the table is gone."""

import gc
import os
import subprocess
import sys
import time

import gpu_flight
import numpy as np
import pyarrow as pa
import pytest

from test_flight import all_types_table, unique


def leases(server):
    return server.status()["leases"]


def held(server):
    """Bytes the server's budgets hold: the device budget (where the host backend charges the
    files) and the host tier's (where the cuda backend does)."""
    status = server.status()
    return status["devices"][0]["used_bytes"] + status["tiers"]["host_used_bytes"]


def settle(server, baseline):
    gc.collect()
    server.wait_for(lambda: leases(server) == [] and held(server) == baseline, timeout=10)


@pytest.fixture
def shared(make_server, tmp_path):
    # Reads of more than 1,000 rows come in several batches, so in several files (up to 3).
    return make_server(
        "--shm-socket", str(tmp_path / "shm.sock"), "--shm-writers", "3", "--rows-per-endpoint", "1000"
    )


def mapped_ranges():
    """The address ranges this process maps the server's shared-memory files at."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "memfd:gpu-flight-shm-read" in line:
                start, end = line.split()[0].split("-")
                ranges.append((int(start, 16), int(end, 16)))
    return ranges


def buffers(table):
    for column in table.columns:
        for chunk in column.chunks:
            stack = [chunk]
            while stack:
                array = stack.pop()
                yield from (b for b in array.buffers() if b is not None and b.size > 0)
                if pa.types.is_dictionary(array.type):
                    stack.append(array.dictionary)


def assert_zero_copy(table):
    ranges = mapped_ranges()
    assert ranges, "the file is mapped"
    for buffer in buffers(table):
        assert any(start <= buffer.address < end for start, end in ranges), "zero-copy"


def test_rows_match_get_and_lie_in_the_mapping(shared):
    table = all_types_table(5000)
    with gpu_flight.connect(shared.location) as client:
        name = unique()
        client.put(name, table)
        baseline = held(shared)
        got = client.read_shared(name)
        assert got.equals(client.get(name))
        assert got.equals(table)
        assert_zero_copy(got)
        assert len(mapped_ranges()) == 3, "five batches in three files"
        assert len(leases(shared)) == 1
        assert leases(shared)[0]["staged_bytes"] > 0
        # A column taken from the table keeps the mapping and the lease.
        column = got.column(0)
        del got
        gc.collect()
        assert len(leases(shared)) == 1
        assert column.to_pylist() == table.column(0).to_pylist()
        del column
        settle(shared, baseline)
        assert mapped_ranges() == []


def test_columns_and_where_as_get_takes_them(shared):
    table = pa.table(
        {"a": np.arange(10_000), "b": np.arange(10_000) * 2.0, "c": [str(i) for i in range(10_000)]}
    )
    with gpu_flight.connect(shared.location) as client:
        name = unique()
        client.put(name, table)
        baseline = held(shared)
        got = client.read_shared(name, columns=["c", "a"], where="a >= 9000 AND b < 19000")
        assert got.equals(client.get(name, columns=["c", "a"], where="a >= 9000 AND b < 19000"))
        assert got.num_rows == 500
        del got
        settle(shared, baseline)
        with pytest.raises(pa.ArrowKeyError):
            client.read_shared(unique())
        with pytest.raises(pa.ArrowInvalid):
            client.read_shared(name, columns=["nope"])
        settle(shared, baseline)


def test_a_server_without_the_socket_refuses(server):
    with gpu_flight.connect(server.location) as client:
        name = unique()
        client.put(name, pa.table({"a": [1, 2, 3]}))
        with pytest.raises(pa.ArrowException, match="--shm-socket"):
            client.read_shared(name)


def test_a_table_outlives_a_short_lease_because_it_is_renewed(shared):
    table = pa.table({"a": np.arange(100_000), "b": np.arange(100_000) * 0.5})
    with gpu_flight.connect(shared.location) as client:
        name = unique()
        client.put(name, table)
        baseline = held(shared)
        got = client.read_shared(name, lease_seconds=2)
        charged = leases(shared)[0]["staged_bytes"]
        assert charged > 0
        time.sleep(5)
        # Checked before the table is read: a revoked file's pages fault (SIGBUS) when read.
        still = leases(shared)
        assert len(still) == 1, "renewed past its two seconds"
        assert still[0]["staged_bytes"] == charged
        assert held(shared) >= baseline + charged, "still charged"
        assert got.equals(table)
        del got
        settle(shared, baseline)
        assert mapped_ranges() == []


def test_a_lease_is_renewed_only_while_held(tmp_path):
    from gpu_flight import _lease

    renewals = []
    lease = _lease._Lease(lambda _lease: None, "l" * 32)
    lease.keep_renewed(lambda lease_id, seconds: renewals.append((lease_id, seconds)), 2)
    lease.renew_if_due(time.monotonic())
    assert renewals == [], "not due before half its term"
    lease.renew_if_due(time.monotonic() + 1.1)
    assert renewals == [("l" * 32, 2)]

    def gone(lease_id, seconds):
        raise KeyError(lease_id)

    lease.keep_renewed(gone, 2)
    lease.renew_if_due(time.monotonic() + 5)
    assert lease.renewal_due() is None, "NOT_FOUND stops the renewals"
    lease.end_at_exit()


CONSUMER = """
import os, sys
import gpu_flight
with gpu_flight.connect(sys.argv[1]) as client:
    table = client.read_shared(sys.argv[2], lease_seconds=2)
    assert table.num_rows == 1000
    print("mapped", flush=True)
    os._exit(0)  # dies holding the table: nothing released
"""


def test_a_consumer_that_dies_leaks_nothing(shared):
    with gpu_flight.connect(shared.location) as client:
        name = unique()
        client.put(name, pa.table({"a": np.arange(1000)}))
        baseline = held(shared)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", CONSUMER, shared.location, name], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    assert "mapped" in done.stdout
    assert len(leases(shared)) == 1, "held until the lease ends"
    settle(shared, baseline)


def fake_side_channel(path, answers):
    """A side channel at `path` giving `answers` to successive connections (`ok` ones with a
    descriptor); returns the thread serving it and the list of tokens it received."""
    import socket
    import threading

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(len(answers))
    received = []

    def serve():
        with listener:
            for answer in answers:
                connection, _ = listener.accept()
                with connection:
                    received.append(connection.recv(128))
                    if answer.startswith("ok"):
                        words = answer.split()
                        pipes = [os.pipe() for _ in range(int(words[2]) if len(words) == 3 else 1)]
                        socket.send_fds(connection, [answer.encode() + b"\n"], [r for r, _ in pipes])
                        for pipe in pipes:
                            os.close(pipe[0])
                            os.close(pipe[1])
                    else:
                        connection.sendall(answer.encode() + b"\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread, received


def test_a_busy_side_channel_is_asked_again_and_a_refusal_is_not(tmp_path):
    from gpu_flight import _shared

    busy = "error busy: too many connections at once; try again"
    thread, received = fake_side_channel(str(tmp_path / "a.sock"), [busy, busy, "ok 3"])
    fds = _shared._receive_fds(str(tmp_path / "a.sock"), "t" * 64)
    assert len(fds) == 1
    os.close(fds[0])
    thread.join(5)
    assert received == [b"t" * 64 + b"\n"] * 3

    thread, received = fake_side_channel(str(tmp_path / "c.sock"), ["ok 6 2"])
    fds = _shared._receive_fds(str(tmp_path / "c.sock"), "v" * 64)
    assert len(fds) == 2, "every file's descriptor"
    for fd in fds:
        os.close(fd)
    thread.join(5)

    thread, received = fake_side_channel(str(tmp_path / "b.sock"), ["error no such token"])
    with pytest.raises(pa.ArrowInvalid, match="no such token"):
        _shared._receive_fds(str(tmp_path / "b.sock"), "u" * 64)
    thread.join(5)
    assert len(received) == 1
