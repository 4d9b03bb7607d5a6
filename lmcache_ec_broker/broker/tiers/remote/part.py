"""What the remote policy's parts (``ordering.py``, ``lookups.py``, ``discovery.py``) call
on the policy itself: ``RemotePolicy`` is one object in parts, mixins over its state,
and this is the one declaration of the methods they share.

Every part derives from ``PolicyPart``, so C3 puts it after all of them in
``RemotePolicy``'s method order: a declaration here never hides a definition, in the
policy or in another part, whatever order the parts are listed in. The methods are
abstract: a policy that lacks one cannot be made (TypeError at construction) instead
of answering None from a placeholder.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

from .transport import Node


class PolicyPart(abc.ABC):
    """A part of ``RemotePolicy`` (see the module docstring)."""

    # ---------------------------------------------------- the policy's (policy.py)

    @abc.abstractmethod
    def _next_id(self) -> int:
        """A fresh job id."""

    @abc.abstractmethod
    def _learn(self, key: str) -> bool:
        """Fold ``key`` into the filter; True if it was new."""

    @abc.abstractmethod
    def _forget(self, key: str) -> bool:
        """Take ``key`` out of the filter; True if it was there."""

    @abc.abstractmethod
    def _blocked(self, key: str) -> bool:
        """A lookup must miss ``key`` without asking (a delete or clear is pending)."""

    @abc.abstractmethod
    def _fail(self, nodes: Sequence[Node]) -> None:
        """A failure of each of ``nodes`` for their circuit breakers."""

    @abc.abstractmethod
    def _ok(self, nodes: Sequence[Node]) -> None:
        """A success of each of ``nodes`` for their circuit breakers."""

    @abc.abstractmethod
    def refuse(self, key: str, why: object) -> None:
        """Remember ``key``'s value as refused (rule 3) and forget the key."""

    # ---------------------------------------------- key discovery's (discovery.py)

    @abc.abstractmethod
    def _echo_sent(self, keys: Sequence[str]) -> None:
        """This broker announced ``keys``: their echoes are not news."""
