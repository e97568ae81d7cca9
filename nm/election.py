"""Primary election with kazoo's Election recipe, run on a thread of its own.

``lead(resign)`` is called on the election thread when this NM wins; it must return soon after
``resign`` is set. Returning releases the leadership (the lock node is deleted, so the next
contender takes over at once); the thread then contends again unless stopped. A fresh
``Election`` (a fresh Lock) is made for each round: a Lock whose release failed (session gone)
would otherwise believe it still holds the lock.

The recipe is a lock: contenders queue as ephemeral sequential nodes and each watches only the
one before it, so when the primary's session ends (a crash: after the session timeout; a
graceful close: at once) exactly one backup wakes up.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from kazoo.client import KazooClient

log = logging.getLogger(__name__)

_SEQ = re.compile(r"__lock__(\d{10})$")  # kazoo's Lock node names: <uuid>__lock__<sequence>


class PrimaryElection:
    def __init__(self, zk: "KazooClient", path: str, identifier: str,
                 lead: Callable[[threading.Event], None]) -> None:
        self.zk, self.path, self.identifier, self.lead = zk, path, identifier, lead
        self.resign = threading.Event()
        self._stopped = threading.Event()
        self._election = None
        self._thread = threading.Thread(target=self._run, name="nm-election", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.is_set():
            self.resign.clear()
            self._election = self.zk.Election(self.path, self.identifier)
            if self._stopped.is_set():  # stop() may have cancelled the previous round's object
                break
            try:
                self._election.run(self._lead)
            except Exception as e:  # a lost connection while contending or releasing
                if not self._stopped.is_set():
                    log.warning("election round ended: %r", e)
            # Bounded pause before contending again, so a broken connection cannot spin.
            self._stopped.wait(0.1)

    def _lead(self) -> None:
        if self._stopped.is_set():
            return
        try:
            self.lead(self.resign)
        except Exception:
            log.exception("leading failed; giving the leadership up")

    def step_down(self) -> None:
        """Give up the leadership (if held) and contend again."""
        self.resign.set()

    def contenders(self, timeout: float = 0.5) -> list[str]:
        """Identifiers in line, the primary first. Read as kazoo's ``Election.contenders`` does
        (lock nodes ordered by their sequence suffix, identifiers from their data), but with
        bounded waits: the NM's loop asks this for ``status`` and must not hang on ZooKeeper."""
        from onepiece.nm.zk import wait

        nodes = wait(self.zk.get_children_async(self.path), timeout)
        nodes = sorted((n for n in nodes if _SEQ.search(n)), key=lambda n: _SEQ.search(n).group(1))
        pending = [self.zk.get_async(f"{self.path}/{n}") for n in nodes]
        out = []
        for r in pending:
            try:
                out.append(wait(r, timeout)[0].decode("utf-8"))
            except Exception:  # a contender that left meanwhile
                continue
        return out

    def stop(self, timeout: float = 2.0) -> None:
        self._stopped.set()
        if self._election is not None:
            self._election.cancel()
        self.resign.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
