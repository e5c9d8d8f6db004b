"""The JSON documents the server returns (put results and action results) as typed objects.

Each keeps the server's whole document in `raw`, so fields a newer server adds are not lost.
"""

from __future__ import annotations

import builtins
import json
from dataclasses import dataclass, field
from typing import Any, Union

Device = Union[int, str]
"""A device as the server names it: its number (from `status`) or a GPU's UUID ("GPU-…")."""


def parse(body: bytes, what: str) -> dict[str, Any]:
    """The JSON object in `body`; a TypeError names `what` if the server sent something else."""
    document = json.loads(body)
    if not isinstance(document, dict):
        raise TypeError(f"the server's {what} is not a JSON object: {body[:200]!r}")
    return document


@dataclass(frozen=True)
class PutResult:
    """What the server answers a committed put with.

    `rows` and `bytes` (Arrow bytes) are this put's; `total_rows` and `total_bytes` are the
    dataset's after it.
    """

    name: str
    mode: str
    rows: int
    bytes: int
    total_rows: int
    total_bytes: int
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, body: builtins.bytes) -> PutResult:
        doc = parse(body, "put result")
        return cls(
            name=doc["name"],
            mode=doc["mode"],
            rows=int(doc["rows"]),
            bytes=int(doc["bytes"]),
            total_rows=int(doc["total_rows"]),
            total_bytes=int(doc["total_bytes"]),
            raw=doc,
        )


@dataclass(frozen=True)
class DropResult:
    """The `drop` action's answer: the dropped dataset's rows and Arrow bytes."""

    name: str
    rows: int
    bytes: int
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, body: builtins.bytes) -> DropResult:
        doc = parse(body, "drop result")
        return cls(name=doc["name"], rows=int(doc["rows"]), bytes=int(doc["bytes"]), raw=doc)


@dataclass(frozen=True)
class MoveResult:
    """The `move` action's answer: the dataset's new version lies wholly on `device`."""

    name: str
    device: int
    moved_bytes: int
    version: int
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, body: builtins.bytes) -> MoveResult:
        doc = parse(body, "move result")
        return cls(
            name=doc["name"],
            device=doc["device"],
            moved_bytes=int(doc["moved_bytes"]),
            version=int(doc["version"]),
            raw=doc,
        )


@dataclass(frozen=True)
class CopyResult:
    """The `copy` action's answer: `as_name` is a new dataset with every row of `name`."""

    name: str
    as_name: str
    device: int
    copied_bytes: int
    version: int
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, body: builtins.bytes) -> CopyResult:
        doc = parse(body, "copy result")
        return cls(
            name=doc["name"],
            as_name=doc["as"],
            device=doc["device"],
            copied_bytes=int(doc["copied_bytes"]),
            version=int(doc["version"]),
            raw=doc,
        )
