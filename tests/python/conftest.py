"""Fixtures: the real gpu-flight binary on a free port, and pyarrow.flight clients for it.

Environment:
  GPU_FLIGHT_BIN      the binary to run (default: target/debug/gpu-flight)
  GPU_FLIGHT_BACKEND  the backend to ask for (default: host); the GPU machine runs with cuda
"""

import json
import os
import pathlib
import re
import resource
import subprocess
import time

import pyarrow.flight as flight
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BINARY = os.environ.get("GPU_FLIGHT_BIN", str(ROOT / "target" / "debug" / "gpu-flight"))
BACKEND = os.environ.get("GPU_FLIGHT_BACKEND", "host")


def new_token(principal, role):
    """A `[[tokens]]` entry and its bearer token, from `gpu-flight new-token`."""
    done = subprocess.run(
        [BINARY, "new-token", "--principal", principal, "--role", role],
        capture_output=True, text=True, check=True,
    )
    token = done.stderr.strip().splitlines()[-1]
    return done.stdout, token


class Server:
    """One gpu-flight process; `location` is its grpc:// (or grpc+tls://) address.

    Options (all default to the plain server): `log`, a path its stderr (the log) is written to
    instead of being discarded; `env`, extra environment variables; `nofile`, a limit on its
    open files (RLIMIT_NOFILE), set in the child before it starts.
    """

    def __init__(self, *flags, log=None, env=None, nofile=None):
        self.log = log
        stderr = subprocess.DEVNULL if log is None else open(log, "wb")
        preexec = None if nofile is None else lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
        try:
            self.process = subprocess.Popen(
                [BINARY, "serve", "--listen", "127.0.0.1:0", "--backend", BACKEND, *flags],
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                env=None if env is None else {**os.environ, **env},
                preexec_fn=preexec,
            )
        finally:
            if log is not None:
                stderr.close()
        line = self.process.stdout.readline()
        match = re.search(r"serving on (grpc(?:\+tls)?://\S+)", line)
        if not match:
            self.process.kill()
            self.process.wait()
            said = "" if log is None else pathlib.Path(log).read_text(errors="replace")[-2000:]
            raise RuntimeError(f"gpu-flight did not start: {line!r} {said}")
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
    """Starts extra servers with their own flags (and `Server`'s options); stops them after
    the test."""
    started = []

    def start(*flags, **options):
        started.append(Server(*flags, **options))
        return started[-1]

    yield start
    for server in started:
        server.stop()
