"""Reading and creating DB records with failover (DESIGN §7), sync and asyncio.

Every call orders the set's DB control addresses with ``db.placement.order(uid, ...)``, so
the proxy and every reader agree which DB holds a UID first. Reads ask in that order: on a
miss or a timeout, the next; ``create`` writes to the first DB that accepts.

One RPC client per address is kept and reused. After a timeout that client is closed and
rebuilt on next use (the "lazy pirate" pattern): a DEALER queues requests for a peer that is
down, and closing it with linger 0 discards them, so a dead DB can never fill the queue and
block a send. A DB that timed out is tried last for ``down_s`` seconds, so reads of other
UIDs do not each pay its timeout.

Each operation is written once, as a plan (a generator in :class:`_Failover`): it yields the
RPC calls it wants, ``(address, op, args)``, and gets back each reply, or has the call's
RpcError thrown in at the ``yield``. The sync and asyncio clients differ only in how they
carry out a call (``_call``) and so in the driver that runs a plan (``_run``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Generator

from onepiece.db.listing import created_key
from onepiece.db.placement import order
from onepiece.db.protocol import merge
from onepiece.transport.rpc import AsyncRpcClient, RpcClient, RpcError, RpcTimeout


class DbError(RuntimeError):
    """A DB operation that no DB of the set could carry out."""


class DbUnavailable(DbError):
    """No DB of the set answered."""


class DbFull(DbError):
    """Every DB that answered refused the record because its store is full."""


class DbGone(DbError):
    """A create-once whose UID a DB dropped within a TTL (or holds for another owner)."""


class NotReady(DbError):
    """The record exists but is not completed yet; ``record`` is its current state."""

    def __init__(self, message: str, record: dict[str, Any] | None) -> None:
        super().__init__(message)
        self.record = record


def _reason(e: RpcError, op: str) -> str:
    # RpcError text is "<op>: <server error>"; the server's errors start with a fixed word.
    return str(e).removeprefix(f"{op}: ")


# A plan yields (address, op, args), is sent the call's (reply, blobs) or thrown its RpcError,
# and returns the operation's result.
Call = tuple[str, str, dict[str, Any]]
Plan = Generator[Call, tuple[dict, list[bytes]], Any]


class _Failover:
    """Address ordering, down-marking and the operations' failover logic, shared by the sync
    and async clients."""

    def __init__(self, control_addresses: list[str], timeout: float, down_s: float) -> None:
        if not control_addresses:
            raise ValueError("DbClient needs at least one DB control address")
        self.addresses = list(dict.fromkeys(control_addresses))
        self.timeout = timeout
        self.down_s = down_s
        self._down_until: dict[str, float] = {}

    def _order(self, uid: str) -> list[str]:
        now = time.monotonic()
        ranked = order(uid, self.addresses)
        up = [a for a in ranked if self._down_until.get(a, 0.0) <= now]
        return up + [a for a in ranked if a not in up]

    def _mark(self, address: str, ok: bool) -> None:
        if ok:
            self._down_until.pop(address, None)
        else:
            self._down_until[address] = time.monotonic() + self.down_s

    # ---- plans -------------------------------------------------------------------------------

    def _create(self, record: dict[str, Any], if_absent: bool = False) -> Plan:
        uid = record["uid"]
        errors: list[str] = []
        for address in self._order(uid):
            try:
                reply, _ = yield address, "create", {"record": record, **({"if_absent": True} if if_absent else {})}
                return address, reply
            except RpcError as e:
                if _reason(e, "create").startswith("gone"):
                    # Decided: a later DB that never held it must not create it again.
                    raise DbGone(f"create {uid}: {_reason(e, 'create')}") from None
                errors.append(f"{address}: {e}")
        raise _create_error(uid, errors)

    def _get(self, uid: str, owner: str | None = None, op: str = "get") -> Plan:
        answered, errors = False, []
        for address in self._order(uid):
            try:
                reply, _ = yield address, op, _args(uid, owner)
                return reply["record"]
            except RpcTimeout as e:
                errors.append(str(e))
            except RpcError:
                answered = True
        if answered:
            return None
        raise DbUnavailable(f"{op} {uid}: no DB answered: {'; '.join(errors)}")

    def _content(self, uid: str, owner: str | None = None) -> Plan:
        answered, not_ready, errors = False, False, []
        for address in self._order(uid):
            try:
                reply, blobs = yield address, "content", _args(uid, owner)
                return reply["record"], bytes(blobs[0]) if blobs else b""
            except RpcTimeout as e:
                errors.append(str(e))
            except RpcError as e:
                answered = True
                not_ready |= _reason(e, "content").startswith("not ready")
        if not_ready:
            record = yield from self._get(uid, owner)
            raise NotReady(f"{uid} is {record['status'] if record else 'gone'}", record)
        if answered:
            return None
        raise DbUnavailable(f"content {uid}: no DB answered: {'; '.join(errors)}")

    def _delete(self, uid: str, owner: str | None = None, forget: bool = False) -> Plan:
        answered, deleted = False, False
        args = {**_args(uid, owner), **({"forget": True} if forget else {})}
        for address in self._order(uid):
            try:
                reply, _ = yield address, "delete", args
                answered, deleted = True, deleted or bool(reply.get("deleted"))
            except RpcTimeout:
                continue
            except RpcError:
                answered = True
        if not answered:
            raise DbUnavailable(f"delete {uid}: no DB answered")
        return deleted

    def _list(self, owner: str | None, after: tuple[float, str] | None, limit: int, order: str) -> Plan:
        """A page from every DB that answers, merged: with fewer replicas than DBs no one DB
        holds every record. DBs recently down are asked only when no other answered."""
        args = {"limit": limit, "order": order, **({"owner": owner} if owner is not None else {}),
                **({"after": list(after)} if after is not None else {})}
        now = time.monotonic()
        up = [a for a in self.addresses if self._down_until.get(a, 0.0) <= now]
        pages: list[tuple[list[dict], bool]] = []
        errors: list[str] = []
        for group in (up, [a for a in self.addresses if a not in up]):
            for address in group:
                try:
                    reply, _ = yield address, "list", args
                    pages.append((reply["records"], bool(reply["has_more"])))
                except RpcTimeout as e:
                    errors.append(str(e))
                except RpcError as e:  # an answer: the arguments are wrong everywhere alike
                    raise DbError(_reason(e, "list")) from None
            if pages:
                return merge_pages(pages, limit, order == "desc")
        raise DbUnavailable(f"list: no DB answered: {'; '.join(errors)}")

    def _running(self, before: float) -> Plan:
        """Every answering DB's records not finished yet, created before ``before``, by uid
        (a record several hold is listed once); a DB that does not answer is passed over."""
        out: dict[str, dict[str, Any]] = {}
        for address in self.addresses:
            try:
                reply, _ = yield address, "running", {"before": before}
            except RpcTimeout:
                continue
            except RpcError as e:
                raise DbError(_reason(e, "running")) from None
            for rec in reply["records"]:
                out.setdefault(rec["uid"], rec)
        return out

    def _stats(self) -> Plan:
        out: dict[str, dict[str, Any]] = {}
        for address in self.addresses:
            try:
                reply, _ = yield address, "stats", {}
                out[address] = reply["stats"]
            except RpcError as e:
                out[address] = {"error": str(e)}
        return out


class DbClient(_Failover):
    """Blocking client. Calls are serialised by a lock, so threads may share one."""

    def __init__(self, control_addresses: list[str], timeout: float = 1.0, down_s: float = 2.0) -> None:
        super().__init__(control_addresses, timeout, down_s)
        self._clients: dict[str, RpcClient] = {}
        self._lock = threading.Lock()

    def _call(self, address: str, op: str, args: dict[str, Any]) -> tuple[dict, list[bytes]]:
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = RpcClient(address, timeout=self.timeout, retries=0)
        try:
            out = client.call(op, **args)
        except RpcTimeout:
            self._clients.pop(address).close()
            self._mark(address, ok=False)
            raise
        except RpcError:
            self._mark(address, ok=True)  # it answered, with an error
            raise
        self._mark(address, ok=True)
        return out

    def _run(self, plan: Plan) -> Any:
        with self._lock:
            try:
                step = next(plan)
                while True:
                    try:
                        out, error = self._call(*step), None
                    except RpcError as e:
                        out, error = None, e
                    # Thrown in outside the except block, so what the plan raises in turn does
                    # not chain to the call's error.
                    step = plan.send(out) if error is None else plan.throw(error)
            except StopIteration as done:
                return done.value

    def create(self, record: dict[str, Any]) -> str:
        """Store a new record on the first DB (in placement order) that accepts it; returns
        that DB's control address. Raises DbFull / DbUnavailable / DbError otherwise."""
        return self._run(self._create(record))[0]

    def create_once(self, record: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """Create ``record`` unless its UID exists: (the record held, whether this created it).
        Raises DbGone when the UID was dropped within a TTL or belongs to another owner."""
        reply = self._run(self._create(record, if_absent=True))[1]
        return reply["record"], bool(reply.get("created"))

    def get(self, uid: str, owner: str | None = None) -> dict[str, Any] | None:
        """The record from the first DB that has it; None when every DB that answered lacks
        it (or holds it for an owner other than a given ``owner``). Raises DbUnavailable when
        no DB answered at all."""
        return self._run(self._get(uid, owner))

    def handed(self, uid: str, owner: str | None = None) -> dict[str, Any] | None:
        """Mark the record: its proxy handed it over (proxy/idempotency.py); the record, None
        where no DB has it."""
        return self._run(self._get(uid, owner, op="handed"))

    def running(self, before: float) -> dict[str, dict[str, Any]]:
        """uid -> where it is (uid, app, status, stage), for the requests not finished yet that
        were created before ``before`` (seconds since the epoch), as the DBs that answer see them."""
        return self._run(self._running(before))

    def state(self, uid: str) -> dict[str, Any] | None:
        """As ``get``, but only where the request is (uid, app, status, stage): what a member
        that is not a proxy may read (db/protocol.py PROXY_OPS)."""
        return self._run(self._get(uid, op="state"))

    def content(self, uid: str, owner: str | None = None) -> tuple[dict[str, Any], bytes] | None:
        """(record, artefact) from the first DB that has it completed (it may purge it there
        and on its peers); None when no DB has the record; NotReady when one has it but it is
        not completed."""
        return self._run(self._content(uid, owner))

    def delete(self, uid: str, owner: str | None = None, forget: bool = False) -> bool:
        """Delete on every DB of the set (each tells its peers too); True if any held it.
        ``forget``: no tombstone and no cancel, so the UID may be created again."""
        return self._run(self._delete(uid, owner, forget))

    def list(self, owner: str | None = None, after: tuple[float, str] | None = None, limit: int = 20,
             order: str = "desc") -> tuple[list[dict[str, Any]], bool]:
        """A page of records by creation time (``owner``'s only, unless None) after the
        ``(created_at, uid)`` key ``after``, and whether more follow."""
        return self._run(self._list(owner, after, limit, order))

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per control address: that DB's stats, or ``{"error": ...}``."""
        return self._run(self._stats())

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()

    def __enter__(self) -> "DbClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncDbClient(_Failover):
    """The asyncio twin of DbClient (for the proxy). Use it from one event loop."""

    def __init__(self, control_addresses: list[str], timeout: float = 1.0, down_s: float = 2.0) -> None:
        super().__init__(control_addresses, timeout, down_s)
        self._clients: dict[str, AsyncRpcClient] = {}

    async def _call(self, address: str, op: str, args: dict[str, Any]) -> tuple[dict, list[bytes]]:
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = AsyncRpcClient(address, timeout=self.timeout, retries=0)
        try:
            # The outer bound also covers the send, which AsyncRpcClient does not time.
            out = await asyncio.wait_for(client.call(op, **args), self.timeout + 0.5)
        except (RpcTimeout, asyncio.TimeoutError) as e:
            # This client only: another call may have put a fresh one there meanwhile (and it
            # closed this one when it took it out).
            if self._clients.get(address) is client:
                del self._clients[address]
                client.close()
            self._mark(address, ok=False)
            raise e if isinstance(e, RpcTimeout) else RpcTimeout(f"{op}: no answer from {address}") from None
        except RpcError:
            self._mark(address, ok=True)
            raise
        self._mark(address, ok=True)
        return out

    async def _run(self, plan: Plan) -> Any:
        try:
            step = next(plan)
            while True:
                try:
                    out, error = await self._call(*step), None
                except RpcError as e:
                    out, error = None, e
                step = plan.send(out) if error is None else plan.throw(error)
        except StopIteration as done:
            return done.value

    async def create(self, record: dict[str, Any]) -> str:
        return (await self._run(self._create(record)))[0]

    async def create_once(self, record: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        reply = (await self._run(self._create(record, if_absent=True)))[1]
        return reply["record"], bool(reply.get("created"))

    async def get(self, uid: str, owner: str | None = None) -> dict[str, Any] | None:
        return await self._run(self._get(uid, owner))

    async def handed(self, uid: str, owner: str | None = None) -> dict[str, Any] | None:
        return await self._run(self._get(uid, owner, op="handed"))

    async def content(self, uid: str, owner: str | None = None) -> tuple[dict[str, Any], bytes] | None:
        return await self._run(self._content(uid, owner))

    async def delete(self, uid: str, owner: str | None = None, forget: bool = False) -> bool:
        return await self._run(self._delete(uid, owner, forget))

    async def list(self, owner: str | None = None, after: tuple[float, str] | None = None, limit: int = 20,
                   order: str = "desc") -> tuple[list[dict[str, Any]], bool]:
        return await self._run(self._list(owner, after, limit, order))

    async def stats(self) -> dict[str, dict[str, Any]]:
        return await self._run(self._stats())

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()


def _args(uid: str, owner: str | None) -> dict[str, Any]:
    return {"uid": uid, **({"owner": owner} if owner is not None else {})}


def merge_pages(pages: list[tuple[list[dict[str, Any]], bool]], limit: int,
                descending: bool) -> tuple[list[dict[str, Any]], bool]:
    """One page from the pages several DBs gave for the same request: copies of a record
    merged as replicas converge, the first ``limit`` in order, and whether more follow."""
    held: dict[str, dict[str, Any]] = {}
    for records, _ in pages:
        for rec in records:
            held[rec["uid"]] = merge(held.get(rec["uid"]), rec)
    ordered = sorted(held.values(), key=lambda r: created_key(r["uid"], r.get("created_at")), reverse=descending)
    return ordered[:limit], len(ordered) > limit or any(more for _, more in pages)


def _create_error(uid: str, errors: list[str]) -> DbError:
    if errors and all("store full" in e for e in errors):
        return DbFull(f"create {uid}: every DB is full: {'; '.join(errors)}")
    if errors and all("no answer" in e for e in errors):
        return DbUnavailable(f"create {uid}: no DB answered: {'; '.join(errors)}")
    return DbError(f"create {uid}: refused by every DB: {'; '.join(errors)}")
