"""What the trainer and actor nodes share: closing, and ``with``."""

from __future__ import annotations

from typing import Any, TypeVar

Node = TypeVar("Node", bound="ClosingNode")


class ClosingNode:
    """A node over a ``_core`` node (``self._node``) that ``close()`` stops; the end of a
    ``with`` block closes it."""

    _node: Any

    def close(self) -> None:
        self._node.close()

    @property
    def closed(self) -> bool:
        return self._node.closed

    def __enter__(self: Node) -> Node:
        return self

    def __exit__(self, *exception: object) -> None:
        self.close()
