"""What the modules behind `Client` (exports, device puts, shared-memory reads, leases) need of
it: running an action. A protocol, so that they need not import the client that imports them."""

from __future__ import annotations

from typing import Any, Optional, Protocol


class Actions(Protocol):
    """Runs a server action as `Client._action` does (`Client` is the one implementation)."""

    def _action(
        self,
        action: str,
        body: Optional[dict[str, Any]] = None,
        timeout: Optional[float] = None,
        reconnect: bool = False,
    ) -> bytes: ...
