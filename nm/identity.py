"""Who an instance is: its stable name, not a counter in the NM's memory (issue 15).

An embedded NM keeps nothing across a restart. Handing out ids from a counter, a restarted NM
gave a new instance an id that a live one still held; that one heartbeated as the newcomer and
took over its stage. A member launched under a name (``onepiece up`` names every member) is
now known by that name; what the NM keeps per name is which *process* holds it, a random token
each process draws once (``Membership.process``).

``claim`` is the rule for a registration under a name the NM already knows, a pure function of
the holder's process, the claimant's and when the holder was last heard (nm/elastic.py's
pattern). The same process registering again keeps its place. Another process takes the name
over when the holder has gone silent, which is how a restarted process finds its dead
predecessor: the predecessor is then dropped as dead (what it held is reported failed) and the
newcomer registers under the same id, where the name was last moved. A holder heard within
``held_s`` is alive: the claimant is refused with ``NAME_HELD`` and retries until its
registration times out, so two processes started under one name by mistake never share an id,
and a restart quicker than the holder's silence only waits for it.
"""

from __future__ import annotations

from typing import Literal

# In the refusal a claimant retries on (nm/client.py), and nothing else says it.
NAME_HELD = "is held by a live process"

HELD_HEARTBEATS = 2  # a holder this many heartbeats silent may be taken over by a new process


def held_s(heartbeat_s: float) -> float:
    """How long a holder's silence still counts as alive for ``claim``: two heartbeats, far
    shorter than a restarted process takes to start (its imports alone) and far longer than a
    heartbeat's jitter."""
    return HELD_HEARTBEATS * heartbeat_s


Claim = Literal["same", "held", "replace"]


def claim(holder_process: str, silent_s: float, process: str, held_for_s: float) -> Claim:
    """What a registration by ``process`` under a name held by ``holder_process`` (last heard
    ``silent_s`` ago) does: ``same`` (the holder registering again), ``held`` (refused: the
    holder is alive), ``replace`` (the holder is gone: drop it, then register the claimant)."""
    if process == holder_process:
        return "same"
    return "held" if silent_s < held_for_s else "replace"
