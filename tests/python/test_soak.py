"""A short run of the soak (soak.py) in the suite: many client processes putting, reading,
dropping and failing at once, on a device budget small enough that partitions spill to the
host tier and go back to disk all the time, under --data-dir. Any gRPC code the README does not
document for a request (INTERNAL above all), a torn or mixed read, or memory not given back
fails it. The GPU machine runs the same with GPU_FLIGHT_BACKEND=cuda; longer runs are
`python tests/python/soak.py --minutes 60 ...` by hand."""

import os
import pathlib
import subprocess
import sys

from conftest import BACKEND, BINARY

HERE = pathlib.Path(__file__).resolve().parent


def test_many_clients_with_spills_and_a_data_directory(tmp_path):
    minutes = os.environ.get("GPU_FLIGHT_SOAK_MINUTES", "0.5")
    command = [
        sys.executable, str(HERE / "soak.py"),
        "--binary", BINARY,
        "--minutes", minutes,
        "--clients", os.environ.get("GPU_FLIGHT_SOAK_CLIENTS", "6"),
        "--seed", "22",
        "--memory-limit", "48MiB",
        # The CUDA context, the pinned staging pool kept for reuse (1 GiB) and the pinned host
        # memory for transfers (1 GiB by default) live beside the budgets on a GPU.
        "--rss-overhead", "3GiB" if BACKEND == "cuda" else "768MiB",
        "--server-arg=--host-memory-limit=96MiB",
        f"--server-arg=--data-dir={tmp_path / 'data'}",
        "--log", str(tmp_path / "server.log"),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=float(minutes) * 60 + 240)
    report = result.stdout[-6000:] + result.stderr[-6000:]
    assert result.returncode == 0, report
    assert "spill" in (tmp_path / "server.log").read_text(), "the budget was meant to make partitions spill"
