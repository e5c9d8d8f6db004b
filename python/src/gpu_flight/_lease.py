"""The lease an export holds, and how it ends.

An export's memory stays mapped while anything taken from it is alive (`_Held` objects count
as users of the `_Lease`); the last user to go queues the lease to be ended: its handles
unmapped, then `ipc-release` sent. Ending never runs where the last user went (a finalizer, or
a consumer's release callback, which may come in the middle of anything, the package's own
locks included), but on a lease thread of its own, or at once in `Export.close()` and
`Client.export()`. At interpreter exit every lease still held is released; a forked child
leaves its parent's alone.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import weakref
from typing import TYPE_CHECKING, Callable, Optional

import pyarrow as pa

from . import _cuda

if TYPE_CHECKING:
    from ._client import Client

log = logging.getLogger("gpu_flight")

RELEASE_SECONDS = 5.0
"""The longest an `ipc-release` may take: it runs at exit and on the lease thread, where a
server that does not answer must not hold the process (the lease then expires)."""


def _release(client: Client, lease: str) -> None:
    try:
        client._action("ipc-release", {"lease": lease}, timeout=RELEASE_SECONDS, reconnect=True)
    except pa.ArrowKeyError:
        pass  # NOT_FOUND: it expired already
    except pa.ArrowException as error:
        log.warning("export lease %s was not released (%s); it expires on the server", lease, error)


class _Lease:
    """The server's lease on an export and what this process opened under it: the mapped
    handles and the sync events. Counts its users (the Export and everything handed out);
    when the last one goes, the lease is queued to be ended: unmapped, then released.

    Ending never runs where the last user went (a finalizer, or a consumer's release callback,
    which may come in the middle of anything, the package's own locks included), but on the
    lease thread, or at once in `Export.close()` and `Client.export()`."""

    def __init__(self, release_lease: Callable[[str], None], lease: str) -> None:
        self.lease = lease
        self._release_lease = release_lease
        self._lock = threading.Lock()
        self._users = 1  # the Export's own
        self._pid = os.getpid()
        self.ended = False
        self.done = threading.Event()  # set once end() has run
        self.mappings: list[tuple[bytes, int]] = []
        self.events: dict[int, _cuda.Event] = {}
        _live_leases.add(self)

    def acquire(self) -> None:
        with self._lock:
            if self.ended:
                raise RuntimeError("the export's lease has ended; its memory is no longer mapped")
            self._users += 1

    def release(self) -> None:
        if os.getpid() != self._pid:
            return  # a forked child: the lease and the mappings are the parent's
        with self._lock:
            self._users -= 1
            last = self._users == 0 and not self.ended
            if last:
                self.ended = True
        if last:
            _ending.put(self)  # SimpleQueue.put is safe from finalizers and callbacks

    def users(self) -> int:
        with self._lock:
            return self._users

    def end(self, unmap: bool = True) -> None:
        """Unmaps every handle and destroys the events, then releases the lease; if any
        unmap failed, the lease is left to expire instead (the server may reuse memory
        once it ends, and a handle is still mapped)."""
        try:
            self._end(unmap)
        finally:
            self.done.set()

    def _end(self, unmap: bool) -> None:
        mappings, events = self.mappings, list(self.events.values())
        self.mappings, self.events = [], {}
        failures = []
        if unmap:
            for handle, ordinal in mappings:
                try:
                    _cuda.MAPPINGS.release(handle, ordinal)
                except Exception as error:  # every handle is tried, whatever one does
                    failures.append(error)
            for event in events:
                try:
                    event.destroy()
                except Exception as error:
                    failures.append(error)
        if failures:
            log.warning(
                "export lease %s: %d handles or events could not be closed (%s); the lease is left to expire",
                self.lease,
                len(failures),
                failures[0],
            )
            return
        self._release_lease(self.lease)

    def end_at_exit(self) -> None:
        """At interpreter exit: the lease is released; the mappings die with the process."""
        if os.getpid() != self._pid:
            return
        with self._lock:
            if self.ended:
                return
            self.ended = True
        self._release_lease(self.lease)


_live_leases: weakref.WeakSet[_Lease] = weakref.WeakSet()
_ending: queue.SimpleQueue[_Lease] = queue.SimpleQueue()
_ender: Optional[threading.Thread] = None
_ender_pid = 0


def end_pending() -> None:
    """Ends the leases whose last user has gone, here and now (a safe point)."""
    while True:
        try:
            lease = _ending.get_nowait()
        except queue.Empty:
            return
        lease.end()


def _end_leases_forever() -> None:
    while True:
        lease = _ending.get()
        try:
            lease.end()
        except Exception:  # the thread must outlive any one lease
            log.exception("ending export lease %s", lease.lease)


def _start_lease_thread() -> None:
    """Starts the thread that ends leases, once per process (called where it is safe to)."""
    global _ender, _ender_pid
    if _ender is None or _ender_pid != os.getpid() or not _ender.is_alive():
        _ender = threading.Thread(target=_end_leases_forever, name="gpu-flight-leases", daemon=True)
        _ender_pid = os.getpid()
        _ender.start()


@atexit.register
def _release_leases_at_exit() -> None:
    while True:  # leases queued to end: released only; the mappings die with the process
        try:
            _ending.get_nowait().end(unmap=False)
        except queue.Empty:
            break
    for lease in list(_live_leases):
        lease.end_at_exit()


class _Held:
    """Something handed out that keeps its export's memory mapped while it is alive."""

    def __init__(self, lease: _Lease) -> None:
        lease.acquire()
        self._lease = lease
        weakref.finalize(self, lease.release)

    def _check(self) -> None:
        if self._lease.ended:
            raise RuntimeError("the export's lease has ended; its memory is no longer mapped")
