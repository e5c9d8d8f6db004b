"""Shared-memory reads (`Client.read_shared`): a dataset's rows as an Arrow IPC file in the
server's shared memory, mapped into this process without a copy.

The server's `shm-read` action stages the rows in sealed memory files (several, written at once:
batch `i` of the read is in file `i % K`) and answers a one-time token and the path of its
side-channel socket (docs/protocol.md). The token, sent there, brings back the files'
descriptors (`SCM_RIGHTS`), each mapped read-only with `pyarrow.memory_map`; the table's batches
are those of the files, interleaved back into the read's order, their buffers pointing into the
mappings.

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
from collections.abc import Iterator, Sequence
from typing import Any, Optional

import pyarrow as pa

from ._actions import Actions
from ._documents import parse
from ._lease import _Held, _Lease, _release, _renew, _start_lease_thread, end_pending

DEFAULT_LEASE_SECONDS = 300
SIDE_CHANNEL_SECONDS = 10.0
"""The longest the side channel's exchange may take."""
MAX_ANSWER_BYTES = 4096
MAX_FILES = 64
"""The most descriptors a claim may bring (the server sends at most 8)."""


class _Mapping(_Held):
    """A shared-memory file mapped here: keeps the lease while any buffer of it is alive (and
    the lease thread renews it meanwhile)."""

    def __init__(self, lease: _Lease, mapped: pa.MemoryMappedFile, whole: pa.Buffer) -> None:
        super().__init__(lease)
        self.mapped = mapped
        self.whole = whole


BUSY_RETRIES = 20
"""How often a claim the side channel answered `busy` is tried again, 0.1 s further apart each
time: its connections time out after 2 s, well inside a token's life."""


def _receive_fds(path: str, token: str) -> list[int]:
    """Trades `token` for the files' descriptors on the side channel at `path`, in order,
    trying again while the channel is busy (a busy answer does not spend the token)."""
    for attempt in range(BUSY_RETRIES):
        text, fds = _exchange(path, token)
        if fds is not None:
            return fds
        if not text.startswith("error busy"):
            break
        time.sleep(0.1 * (attempt + 1))
    raise pa.ArrowInvalid(f"the server's shared-memory side channel refused: {text or 'no answer'}")


def _exchange(path: str, token: str) -> tuple[str, Optional[list[int]]]:
    """One exchange on the side channel: its answer, and the descriptors where it sent them
    (`ok <bytes> <files>`, as many as it says)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as side:
        side.settimeout(SIDE_CHANNEL_SECONDS)
        side.connect(path)
        side.sendall(token.encode() + b"\n")
        answer = b""
        fds: list[int] = []
        while not answer.endswith(b"\n") and len(answer) < MAX_ANSWER_BYTES:
            data, received, _flags, _address = socket.recv_fds(side, MAX_ANSWER_BYTES, MAX_FILES)
            fds.extend(received)
            if not data:
                break
            answer += data
    text = answer.decode(errors="replace").strip()
    words = text.split()
    files = int(words[2]) if len(words) == 3 and words[2].isdigit() else 1
    if words[:1] != ["ok"] or not fds or len(fds) != files:
        for fd in fds:
            os.close(fd)
        return text, None
    return text, fds


def read_shared(
    client: Actions,
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
        fds = _receive_fds(document["socket"], document["token"])
        try:
            files = [_read_file(lease, fd) for fd in fds]
        finally:
            for fd in fds:
                os.close(fd)
        schema = files[0].schema
        readers = [iter(file) for file in files]
        count = sum(len(file) for file in files)
        # Batch i of the read is batch i // K of file i % K (`order`: round-robin).
        batches = [next(readers[i % len(readers)]) for i in range(count)]
        table = pa.Table.from_batches(batches, schema=schema)
        lease.keep_renewed(functools.partial(_renew, client), int(document["lease_seconds"]))
    finally:
        lease.release()  # this call's own use; the mapping's, if any, keeps the lease
    return table


class _File:
    """The batches of one shared-memory file, mapped here."""

    def __init__(self, reader: pa.ipc.RecordBatchFileReader) -> None:
        self.schema = reader.schema
        self.batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        return iter(self.batches)


def _read_file(lease: _Lease, fd: int) -> _File:
    """Maps the file `fd` opens, read-only, and reads its batches without a copy."""
    mapped = pa.memory_map(f"/proc/self/fd/{fd}", "r")
    whole = mapped.read_buffer()
    # The batches' buffers are slices of this one, whose base keeps the mapping and the lease.
    holder = _Mapping(lease, mapped, whole)
    shared = pa.foreign_buffer(whole.address, whole.size, base=holder)
    return _File(pa.ipc.open_file(shared))
