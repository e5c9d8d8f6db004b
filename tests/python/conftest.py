"""Fixtures: the real gpu-flight binary on a free port, and pyarrow.flight clients for it.

Environment:
  GPU_FLIGHT_BIN      the binary to run (default: target/debug/gpu-flight)
  GPU_FLIGHT_BACKEND  the backend to ask for (default: host); the GPU machine runs with cuda
"""

import json
import os
import pathlib
import re
import subprocess
import time

import pyarrow.flight as flight
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BINARY = os.environ.get("GPU_FLIGHT_BIN", str(ROOT / "target" / "debug" / "gpu-flight"))
BACKEND = os.environ.get("GPU_FLIGHT_BACKEND", "host")


class Server:
    """One gpu-flight process; `location` is its grpc:// address."""

    def __init__(self, *flags):
        self.process = subprocess.Popen(
            [BINARY, "serve", "--listen", "127.0.0.1:0", "--backend", BACKEND, *flags],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        line = self.process.stdout.readline()
        match = re.search(r"serving on (grpc://\S+)", line)
        if not match:
            self.process.kill()
            raise RuntimeError(f"gpu-flight did not start: {line!r}")
        self.location = match.group(1)

    def client(self, **kwargs):
        return flight.connect(self.location, **kwargs)

    def status(self):
        with self.client() as client:
            result = list(client.do_action(flight.Action("status", b"")))
        return json.loads(result[0].body.to_pybytes())

    def used_bytes(self):
        return self.status()["devices"][0]["used_bytes"]

    def wait_for(self, condition, timeout=15.0):
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not reached in {timeout} s")
            time.sleep(0.05)

    def stop(self):
        self.process.terminate()
        try:
            return self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise


@pytest.fixture(scope="session")
def server():
    server = Server()
    yield server
    assert server.stop() == 0, "gpu-flight exits cleanly on SIGTERM"


@pytest.fixture
def client(server):
    with server.client() as client:
        yield client


@pytest.fixture
def make_server():
    """Starts extra servers with their own flags; stops them after the test."""
    started = []

    def start(*flags):
        started.append(Server(*flags))
        return started[-1]

    yield start
    for server in started:
        server.stop()
