"""The API key both servers may require: kept and compared as a digest.

Both sides of the comparison are SHA-256 digests, of equal length whatever was sent, so the
time `hmac.compare_digest` takes says nothing about the key.
"""

from __future__ import annotations

import hashlib
import hmac


class ApiKey:
    """A required key, or none (`None`: every caller is let in)."""

    def __init__(self, key: str | None) -> None:
        self._digest = hashlib.sha256(key.encode()).digest() if key is not None else None

    @property
    def required(self) -> bool:
        return self._digest is not None

    def admits(self, given: bytes | str) -> bool:
        """Whether `given` (the bearer token or query value as sent; empty: none) is the
        key, or no key is required."""
        if self._digest is None:
            return True
        if isinstance(given, str):
            given = given.encode("utf-8", "surrogateescape")
        return hmac.compare_digest(hashlib.sha256(given).digest(), self._digest)
