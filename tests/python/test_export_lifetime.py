"""How an export's lease ends, on a machine without a GPU: the CUDA driver is replaced by a fake
that records what it is asked, since what is under test is the package's own bookkeeping (when
handles close, when and how the server is told, and that nothing can hang or deadlock).
"""

import gc
import logging
import os
import socket
import threading
import time

import gpu_flight
import pyarrow as pa
import pytest
from gpu_flight import _cuda, _lease


class FakeDriver:
    class CUresult:
        CUDA_SUCCESS = 0

    class CUipcMem_flags:
        CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1

    class CUipcMemHandle:
        def __init__(self, _ptr=0):
            self.ptr = _ptr

    def __init__(self):
        self.next = 0x7000_0000
        self.closed = []
        self.fail_close = set()

    def cuDeviceGet(self, ordinal):
        return (0, ordinal)

    def cuDevicePrimaryCtxRetain(self, device):
        return (0, "context")

    def cuCtxPushCurrent(self, context):
        return (0,)

    def cuCtxPopCurrent(self):
        return (0, "context")

    def cuIpcOpenMemHandle(self, handle, flags):
        self.next += 0x10000
        return (0, self.next)

    def cuIpcCloseMemHandle(self, pointer):
        if pointer in self.fail_close:
            return (1,)
        self.closed.append(pointer)
        return (0,)

    def cuGetErrorName(self, error):
        return (0, b"CUDA_ERROR_INVALID_VALUE")


@pytest.fixture
def driver(monkeypatch):
    fake = FakeDriver()
    monkeypatch.setattr(_cuda, "_driver", lambda: fake)
    monkeypatch.setattr(_cuda, "MAPPINGS", _cuda.Mappings())
    monkeypatch.setattr(_cuda, "_primary_context", lambda ordinal: "context")
    return fake


def wait_for(condition, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


class Holder:
    pass


@pytest.mark.parametrize("threshold", [5, 10, 15, 20, 25])
def test_a_collection_inside_the_mapping_lock_cannot_deadlock(driver, threshold):
    """A lease whose last user dies in a reference cycle is ended by the garbage collector,
    which may run while this thread holds the mapping table's lock: it must not end the lease
    there (closing its handles takes that lock)."""
    _lease._start_lease_thread()
    released = []
    lease = _lease._Lease(released.append, "lease-a")
    handle = b"\x01" * 64
    lease.mappings.append((handle, 0))
    _cuda.MAPPINGS.acquire(handle, 0)

    def scenario():
        gc.collect()
        holder = Holder()
        holder.me = holder
        holder.column = _lease._Held(lease)
        lease.release()  # the Export closed; the column in the cycle keeps the lease
        del holder
        gc.set_threshold(threshold)  # the collection comes at an allocation in the lock
        try:
            _cuda.MAPPINGS.acquire(b"\x02" * 64, 0)
        finally:
            gc.set_threshold(700)
        gc.collect()

    worker = threading.Thread(target=scenario, daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), "deadlocked"
    wait_for(lambda: released == ["lease-a"])
    assert _cuda.MAPPINGS.count() == 1, "the other export's handle stays open"


def test_every_handle_is_closed_and_a_failed_close_leaves_the_lease_to_expire(driver, caplog):
    released = []
    lease = _lease._Lease(released.append, "lease-b")
    pointers = []
    for i in range(3):
        handle = bytes([i + 1]) * 64
        pointers.append(_cuda.MAPPINGS.acquire(handle, 0))
        lease.mappings.append((handle, 0))
    driver.fail_close.add(pointers[0])
    with caplog.at_level(logging.WARNING, logger="gpu_flight"):
        lease.release()
        _lease.end_pending()
        assert lease.done.wait(5)
    assert driver.closed == pointers[1:], "the handles after the failure were closed too"
    assert _cuda.MAPPINGS.count() == 0
    assert released == [], "never released while a handle may still be mapped"
    assert "left to expire" in caplog.text


# The child forks beside the lease thread and touches nothing but a pipe before os._exit.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_neither_releases_nor_unmaps_its_parents_leases(driver):
    released = []
    lease = _lease._Lease(released.append, "lease-c")
    handle = b"\x07" * 64
    lease.mappings.append((handle, 0))
    _cuda.MAPPINGS.acquire(handle, 0)
    reading, writing = os.pipe()
    child = os.fork()
    if child == 0:  # the child: no gRPC, no pytest; report what it did and leave
        try:
            lease.release()
            _lease.end_pending()
            _lease._release_leases_at_exit()
            os.write(writing, repr((released, driver.closed)).encode())
        finally:
            os._exit(0)
    os.close(writing)
    report = os.read(reading, 1000).decode()
    os.waitpid(child, 0)
    assert report == "([], [])"
    assert released == [] and _cuda.MAPPINGS.count() == 1


def test_a_release_after_the_client_closed_reaches_the_server(server):
    client = gpu_flight.connect(server.location)
    client.close()
    # The server answers (NOT_FOUND: no such lease), so the call went out on a new connection.
    with pytest.raises(pa.ArrowKeyError, match="not found"):
        client._action("ipc-release", {"lease": "0" * 32}, reconnect=True)
    with pytest.raises(pa.ArrowException, match="closed"):
        client._action("ipc-release", {"lease": "0" * 32})


def test_a_server_that_never_answers_cannot_hold_a_release(monkeypatch, caplog):
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()  # accepts connections and never says a word
    monkeypatch.setattr(_lease, "RELEASE_SECONDS", 0.5)
    try:
        client = gpu_flight.connect(f"grpc://127.0.0.1:{silent.getsockname()[1]}")
        done = threading.Event()

        def release():
            with caplog.at_level(logging.WARNING, logger="gpu_flight"):
                _lease._release(client, "lease-d")
            done.set()

        threading.Thread(target=release, daemon=True).start()
        assert done.wait(10), "the release hung"
        assert "was not released" in caplog.text
    finally:
        silent.close()
