"""The bytes of request bodies the proxy holds at once, across all connections.

Each request may buffer up to ``max_body_bytes`` (its body, read whole before validation); this
bounds their sum, so many concurrent large uploads get 503 instead of growing the process.
Used from the serving event loop only, so plain integers suffice.
"""

from __future__ import annotations


class ByteBudget:
    def __init__(self, total: int) -> None:
        if total <= 0:
            raise ValueError(f"buffered request bytes bound must be positive (got {total})")
        self.total = total
        self.held = 0

    def take(self, n: int) -> bool:
        """Reserve ``n`` more bytes; False (nothing reserved) if that would pass the bound."""
        if self.held + n > self.total:
            return False
        self.held += n
        return True

    def give(self, n: int) -> None:
        self.held = max(0, self.held - n)
