"""A deployment's id: which deployment a member (stage instance, DB, proxy) belongs to.

`onepiece up` makes one per run (or takes the topology's ``deployment``) and hands it to every
process it starts; each member sends it with its registration and every heartbeat, and an NM
refuses a member of another deployment. Without it, the roles of a second deployment pointed
at the first one's NM (the same ports, a copied topology) joined it and disturbed it.

Not a secret: it is on the command lines (``--deployment``) and in ``onepiece status``. A
process started by hand takes it from ``--deployment`` or ``ONEPIECE_DEPLOYMENT``; none given is
the empty id, which only an NM without an id accepts.
"""

from __future__ import annotations

import os
import re
import secrets
from typing import Mapping

FIELD = "deployment"  # in `register` and `heartbeat` requests, and in the NM's status
ENV = "ONEPIECE_DEPLOYMENT"
FLAG = "--deployment"
REFUSED = "member of another deployment"  # how the NM's refusal starts: members recognise it
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def new_id() -> str:
    """A fresh id: random, so two deployments started from one topology never share one."""
    return secrets.token_hex(6)


def check_id(value: str) -> str:
    """``value`` if it may be a deployment id (ValueError otherwise)."""
    if not _ID.match(value):
        raise ValueError(f"{value!r} is not a deployment id (1-64 letters, digits, '.', '_' or '-', "
                         f"starting with a letter or digit)")
    return value


def resolve(value: str | None, environ: Mapping[str, str] = os.environ) -> str:
    """The id a process runs under: ``value`` (a flag), else the environment's, else none ("")."""
    chosen = value if value is not None else environ.get(ENV, "")
    return check_id(chosen) if chosen else ""


def refusal(ours: str, theirs: object) -> str | None:
    """None if a member bringing ``theirs`` belongs to the NM's deployment ``ours``, else why not
    (the text the member logs)."""
    if theirs == ours:
        return None
    def name(v: object) -> str:
        return repr(v) if isinstance(v, str) and v else "none"

    join = f"start it with {FLAG} {ours} (or {ENV}={ours})" if ours else f"start it without {FLAG} or {ENV}"
    return (f"{REFUSED}: this node manager serves deployment {name(ours)}, the member belongs to {name(theirs)}; "
            f"point it at its own deployment's node manager, or {join} to join this one")
