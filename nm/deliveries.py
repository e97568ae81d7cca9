"""What members delivered to which stage instance lately, as their heartbeats say, so that a dead
instance's failure report covers what reached it after its own last heartbeat (issue 15: such a
request failed only at its deadline).

A stage instance's heartbeat names the requests it holds (nm/holdings.py); a request that
arrives after that heartbeat is named by nobody when the instance is SIGKILLed. Its sender knows
it handed it over: every stage instance and proxy reports, with each heartbeat, its recent
deliveries per receiver address and how long ago each was made. The ledger keeps them, on the
NM's clock, for ``horizon_s`` (longer than a death takes to notice). When an instance dies the
NM asks ``sent_to`` for what reached its address since a heartbeat before its last one, and
leaves a ``Grave`` at the address: a delivery to it reported only later (its sender had not
heard of the death yet) is reaped then (``record``'s answer). A new instance registering at the
address (``revive``) ends that: what is delivered there later is the new instance's.

The reaper still reads each request's record first and leaves alone one that moved on past the
stage or ended (nm/reaper.py); the NM also leaves out what a live instance says it holds.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

MAX_PER_ADDRESS = 8192  # deliveries kept per receiver: more than any queue in front of it holds


@dataclass
class Grave:
    """A dead stage instance's address, while late reports of deliveries to it may come."""

    instance: str
    stage: str | None
    set: str
    since: float  # deliveries from this time on may have been lost with it
    until: float  # kept until then (the ledger's horizon)
    reason: str  # why it was declared dead
    reaped: set[str] = field(default_factory=set)  # already reported failed
    process: str = ""  # the dead process's token: what it reaps late is fenced too (nm/fencing.py)


class DeliveryLedger:
    def __init__(self, horizon_s: float) -> None:
        self.horizon_s = horizon_s
        # address -> uid -> when (NM clock), in the order first reported (about oldest first)
        self._sent: dict[str, OrderedDict[str, float]] = {}
        self._born: dict[str, float] = {}  # address -> when an instance last registered there
        self.graves: dict[str, Grave] = {}

    def record(self, report: dict[str, list[tuple[str, float]]], now: float) -> list[tuple[Grave, list[str]]]:
        """Take one member's report (``{address: [(uid, seconds ago), ...]}``); return, per grave
        it names, the deliveries to that dead instance not reaped yet."""
        self.prune(now)
        late = []
        for address, sent in report.items():
            book = self._sent.setdefault(address, OrderedDict())
            for uid, age in sent:
                if uid not in book:  # the first report dates it best; later ones repeat it
                    book[uid] = now - age
            while len(book) > MAX_PER_ADDRESS:
                book.popitem(last=False)
            grave = self.graves.get(address)
            if grave is not None:
                new = [uid for uid, age in sent if now - age >= grave.since and uid not in grave.reaped]
                if new:
                    grave.reaped.update(new)
                    late.append((grave, new))
        return late

    def sent_to(self, address: str, since: float) -> list[str]:
        """The UIDs delivered to ``address`` from ``since`` on, up to the moment another instance
        registered there (what came after is the newcomer's)."""
        born = self._born.get(address)
        until = born if born is not None and born > since else float("inf")
        return [uid for uid, t in self._sent.get(address, {}).items() if since <= t < until]

    def bury(self, address: str, grave: Grave) -> None:
        self.graves[address] = grave

    def revive(self, address: str, now: float) -> None:
        """An instance registered at ``address``: deliveries there are its own from now on."""
        self._born[address] = now
        self.graves.pop(address, None)

    def prune(self, now: float) -> None:
        old = now - self.horizon_s
        for address in list(self._sent):
            book = self._sent[address]
            while book and next(iter(book.values())) < old:
                book.popitem(last=False)
            if not book:
                del self._sent[address]
        for address in [a for a, g in self.graves.items() if g.until < now]:
            del self.graves[address]
        for address in [a for a, t in self._born.items() if t < old]:
            del self._born[address]
