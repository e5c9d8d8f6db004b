"""The lease an export holds, and how it ends.

An export's memory stays mapped while anything taken from it is alive (`_Held` objects count
as users of the `_Lease`); the last user to go queues the lease to be ended: its handles
unmapped, then `ipc-release` sent. Ending never runs where the last user went (a finalizer, or
a consumer's release callback, which may come in the middle of anything, the package's own
locks included), but on a lease thread of its own, or at once in `Export.close()` and
`Client.export()`. At interpreter exit every lease still held is released; a forked child
leaves its parent's alone.

A lease may also be kept renewed while it is held (`_Lease.keep_renewed`): a shared-memory
read's file is revoked by the server when its lease ends, so a table still alive must not
outlive it. The same thread renews such leases once about half their term has passed.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
import weakref
from typing import Callable, Optional

import pyarrow as pa

from . import _cuda
from ._actions import Actions

log = logging.getLogger("gpu_flight")

RELEASE_SECONDS = 5.0
"""The longest an `ipc-release` may take: it runs at exit and on the lease thread, where a
server that does not answer must not hold the process (the lease then expires)."""


def _renew(client: Actions, lease: str, seconds: int) -> None:
    """Extends `lease` by `seconds`; `KeyError` where it has ended (NOT_FOUND)."""
    try:
        client._action(
            "lease-renew", {"lease": lease, "lease_seconds": seconds}, timeout=RELEASE_SECONDS, reconnect=True
        )
    except pa.ArrowKeyError as error:
        raise KeyError(lease) from error


def _release(client: Actions, lease: str) -> None:
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
        # Renewal (`keep_renewed`): how, for how long each time, and when next (monotonic).
        self._renew: Optional[Callable[[str, int], None]] = None
        self.term = 0
        self.renew_at = 0.0
        _live_leases.add(self)

    def event(self, ordinal: int) -> _cuda.Event:
        """The sync event of this lease's arrays on device `ordinal`, made on first use: most
        consumers (CuPy, PyTorch, a column's views) never ask, and making and destroying one
        costs four driver calls per export. Made outside the lock (the driver may take its
        time, and a release callback may run meanwhile); a second one made at the same time
        is destroyed."""
        with self._lock:
            if self.ended:
                raise RuntimeError(f"export lease {self.lease} has ended")
            event = self.events.get(ordinal)
        if event is not None:
            return event
        made = _cuda.Event(ordinal)
        with self._lock:
            kept = None if self.ended else self.events.setdefault(ordinal, made)
        if kept is not made:
            made.destroy()
        if kept is None:
            raise RuntimeError(f"export lease {self.lease} has ended")
        return kept

    def keep_renewed(self, renew: Callable[[str, int], None], term: int) -> None:
        """Has the lease thread renew the lease by `term` seconds, once about half of it has
        passed each time, for as long as it is held."""
        self._renew = renew
        self.term = term
        self.renew_at = time.monotonic() + term / 2
        _ending.put(None)  # wakes the lease thread to plan the renewal

    def renew_if_due(self, now: float) -> None:
        """Renews the lease if it is kept renewed, held, and due; stops renewing it once the
        server says it has ended."""
        renew = self._renew
        if renew is None or self.ended or now < self.renew_at or os.getpid() != self._pid:
            return
        try:
            renew(self.lease, self.term)
        except KeyError:
            if not self.ended:
                log.warning("lease %s ended on the server while held; no longer renewed", self.lease)
            self._renew = None
            return
        except pa.ArrowException as error:
            log.warning("lease %s was not renewed (%s); trying again", self.lease, error)
            self.renew_at = time.monotonic() + max(self.term / 8, 0.25)
            return
        self.renew_at = now + self.term / 2

    def renewal_due(self) -> Optional[float]:
        """When the lease is next to be renewed (monotonic), if it is kept renewed."""
        if self._renew is None or self.ended or os.getpid() != self._pid:
            return None
        return self.renew_at

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
        with self._lock:  # `event()` adds to `events` under it
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
_ending: queue.SimpleQueue[Optional[_Lease]] = queue.SimpleQueue()
"""Leases to end; `None` only wakes the lease thread (a renewal to plan)."""
_ender: Optional[threading.Thread] = None
_ender_pid = 0


def end_pending() -> None:
    """Ends the leases whose last user has gone, here and now (a safe point)."""
    while True:
        try:
            lease = _ending.get_nowait()
        except queue.Empty:
            return
        if lease is not None:
            lease.end()


def _renew_due() -> Optional[float]:
    """Renews the leases that are due; returns the seconds until the next is, if any is kept
    renewed."""
    now = time.monotonic()
    upcoming = []
    for lease in list(_live_leases):
        try:
            lease.renew_if_due(now)
        except Exception:  # the thread must outlive any one lease
            log.exception("renewing lease %s", lease.lease)
        due = lease.renewal_due()
        if due is not None:
            upcoming.append(due)
    return max(min(upcoming) - time.monotonic(), 0.0) if upcoming else None


def _end_leases_forever() -> None:
    while True:
        try:
            lease = _ending.get(timeout=_renew_due())
        except queue.Empty:
            continue
        if lease is None:
            continue
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
            lease = _ending.get_nowait()
        except queue.Empty:
            break
        if lease is not None:
            lease.end(unmap=False)
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
