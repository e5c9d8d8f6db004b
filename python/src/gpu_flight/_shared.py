"""Shared-memory reads (`Client.read_shared`): a dataset's rows as an Arrow IPC file in the
server's shared memory, mapped into this process without a copy.

The server's `shm-read` action stages the rows in a sealed memory file and answers a one-time
token and the path of its side-channel socket (docs/protocol.md). The token, sent there, brings
back the file's descriptor (`SCM_RIGHTS`), which is mapped read-only with `pyarrow.memory_map`;
the table's buffers point into that mapping.

Lifetime. The lease ends (`ipc-release`, on the package's lease thread) once nothing taken from
the table is alive: the mapping's buffer holds the lease as a user (`_lease._Held`), and every
buffer of the table holds the mapping. Until then the lease thread renews it (`lease-renew`)
each time about half of `lease_seconds` has passed: the server revokes the file when the lease
ends, and a mapping of a revoked file faults (SIGBUS) when read. A process that dies or hangs
stops renewing, so its file goes at most `lease_seconds` later.
"""

from __future__ import annotations

import functools
import os
import socket
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

import pyarrow as pa

from ._documents import parse
from ._lease import _Held, _Lease, _release, _renew, _start_lease_thread, end_pending

if TYPE_CHECKING:
    from ._client import Client

DEFAULT_LEASE_SECONDS = 300
SIDE_CHANNEL_SECONDS = 10.0
"""The longest the side channel's exchange may take."""
MAX_ANSWER_BYTES = 4096


class _Mapping(_Held):
    """A shared-memory file mapped here: keeps the lease while any buffer of it is alive."""

    def __init__(self, lease: _Lease, mapped: pa.MemoryMappedFile, whole: pa.Buffer) -> None:
        super().__init__(lease)
        self.mapped = mapped
        self.whole = whole


BUSY_RETRIES = 20
"""How often a claim the side channel answered `busy` is tried again, 0.1 s further apart each
time: its connections time out after 2 s, well inside a token's life."""


def _receive_fd(path: str, token: str) -> int:
    """Trades `token` for the file's descriptor on the side channel at `path`, trying again
    while the channel is busy (a busy answer does not spend the token)."""
    for attempt in range(BUSY_RETRIES):
        text, fd = _exchange(path, token)
        if fd is not None:
            return fd
        if not text.startswith("error busy"):
            break
        time.sleep(0.1 * (attempt + 1))
    raise pa.ArrowInvalid(f"the server's shared-memory side channel refused: {text or 'no answer'}")


def _exchange(path: str, token: str) -> tuple[str, Optional[int]]:
    """One exchange on the side channel: its answer, and the descriptor where it sent one."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as side:
        side.settimeout(SIDE_CHANNEL_SECONDS)
        side.connect(path)
        side.sendall(token.encode() + b"\n")
        answer = b""
        fds: list[int] = []
        while not answer.endswith(b"\n") and len(answer) < MAX_ANSWER_BYTES:
            data, received, _flags, _address = socket.recv_fds(side, MAX_ANSWER_BYTES, 1)
            fds.extend(received)
            if not data:
                break
            answer += data
    text = answer.decode(errors="replace").strip()
    if not text.startswith("ok ") or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        return text, None
    return text, fds[0]


def read_shared(
    client: Client,
    name: str,
    columns: Optional[Sequence[str]],
    where: Optional[str],
    lease_seconds: int,
) -> pa.Table:
    """See `Client.read_shared`."""
    _start_lease_thread()
    end_pending()
    if isinstance(columns, str):
        raise TypeError("columns must be a sequence of column names, not a string")
    body: dict[str, Any] = {"name": name, "lease_seconds": lease_seconds}
    if columns is not None:
        body["columns"] = list(columns)
    if where is not None:
        body["where"] = where
    document = parse(client._action("shm-read", body), "shm-read")
    lease = _Lease(functools.partial(_release, client), document["lease"])
    try:
        fd = _receive_fd(document["socket"], document["token"])
        try:
            mapped = pa.memory_map(f"/proc/self/fd/{fd}", "r")
        finally:
            os.close(fd)
        whole = mapped.read_buffer()
        # The table's buffers are slices of this one, whose base keeps the mapping and the lease.
        holder = _Mapping(lease, mapped, whole)
        shared = pa.foreign_buffer(whole.address, whole.size, base=holder)
        table = pa.ipc.open_file(shared).read_all()
        lease.keep_renewed(functools.partial(_renew, client), int(document["lease_seconds"]))
    finally:
        lease.release()  # this call's own use; the mapping's, if any, keeps the lease
    return table
