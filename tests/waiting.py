"""Waiting in tests: poll a condition until it holds, with a deadline (no fixed sleeps)."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable


def _try(cond: Callable[[], Any], deadline: float, timeout: float, what: str) -> Any:
    """``cond()``'s value if truthy, None to try again; AssertionError past the deadline."""
    out = cond()
    if out:
        return out
    if time.monotonic() > deadline:
        raise AssertionError(f"timed out after {timeout}s waiting for {what}")
    return None


def wait_for(cond: Callable[[], Any], timeout: float = 5.0, what: str = "condition", interval: float = 0.02) -> Any:
    """``cond()``'s first truthy value; AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while (out := _try(cond, deadline, timeout, what)) is None:
        time.sleep(interval)
    return out


async def await_for(cond: Callable[[], Any], timeout: float = 5.0, what: str = "condition",
                    interval: float = 0.02) -> Any:
    """``wait_for`` inside a coroutine: polls without blocking the event loop."""
    deadline = time.monotonic() + timeout
    while (out := _try(cond, deadline, timeout, what)) is None:
        await asyncio.sleep(interval)
    return out
