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

from onepiece.db.placement import order
from onepiece.transport.rpc import AsyncRpcClient, RpcClient, RpcError, RpcTimeout


class DbError(RuntimeError):
    """A DB operation that no DB of the set could carry out."""


class DbUnavailable(DbError):
    """No DB of the set answered."""


class DbFull(DbError):
    """Every DB that answered refused the record because its store is full."""


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

    def _create(self, record: dict[str, Any]) -> Plan:
        uid = record["uid"]
        errors: list[str] = []
        for address in self._order(uid):
            try:
                yield address, "create", {"record": record}
                return address
            except RpcError as e:
                errors.append(f"{address}: {e}")
        raise _create_error(uid, errors)

    def _get(self, uid: str) -> Plan:
        answered, errors = False, []
        for address in self._order(uid):
            try:
                reply, _ = yield address, "get", {"uid": uid}
                return reply["record"]
            except RpcTimeout as e:
                errors.append(str(e))
            except RpcError:
                answered = True
        if answered:
            return None
        raise DbUnavailable(f"get {uid}: no DB answered: {'; '.join(errors)}")

    def _content(self, uid: str) -> Plan:
        answered, not_ready, errors = False, False, []
        for address in self._order(uid):
            try:
                reply, blobs = yield address, "content", {"uid": uid}
                return reply["record"], bytes(blobs[0]) if blobs else b""
            except RpcTimeout as e:
                errors.append(str(e))
            except RpcError as e:
                answered = True
                not_ready |= _reason(e, "content").startswith("not ready")
        if not_ready:
            record = yield from self._get(uid)
            raise NotReady(f"{uid} is {record['status'] if record else 'gone'}", record)
        if answered:
            return None
        raise DbUnavailable(f"content {uid}: no DB answered: {'; '.join(errors)}")

    def _delete(self, uid: str) -> Plan:
        answered, deleted = False, False
        for address in self._order(uid):
            try:
                reply, _ = yield address, "delete", {"uid": uid}
                answered, deleted = True, deleted or bool(reply.get("deleted"))
            except RpcTimeout:
                continue
            except RpcError:
                answered = True
        if not answered:
            raise DbUnavailable(f"delete {uid}: no DB answered")
        return deleted

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
        return self._run(self._create(record))

    def get(self, uid: str) -> dict[str, Any] | None:
        """The record from the first DB that has it; None when every DB that answered lacks
        it. Raises DbUnavailable when no DB answered at all."""
        return self._run(self._get(uid))

    def content(self, uid: str) -> tuple[dict[str, Any], bytes] | None:
        """(record, artefact) from the first DB that has it completed (it may purge it there
        and on its peers); None when no DB has the record; NotReady when one has it but it is
        not completed."""
        return self._run(self._content(uid))

    def delete(self, uid: str) -> bool:
        """Delete on every DB of the set (each tells its peers too); True if any held it."""
        return self._run(self._delete(uid))

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
            stale = self._clients.pop(address, None)
            if stale is not None:
                stale.close()
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
        return await self._run(self._create(record))

    async def get(self, uid: str) -> dict[str, Any] | None:
        return await self._run(self._get(uid))

    async def content(self, uid: str) -> tuple[dict[str, Any], bytes] | None:
        return await self._run(self._content(uid))

    async def delete(self, uid: str) -> bool:
        return await self._run(self._delete(uid))

    async def stats(self) -> dict[str, dict[str, Any]]:
        return await self._run(self._stats())

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()


def _create_error(uid: str, errors: list[str]) -> DbError:
    if errors and all("store full" in e for e in errors):
        return DbFull(f"create {uid}: every DB is full: {'; '.join(errors)}")
    if errors and all("no answer" in e for e in errors):
        return DbUnavailable(f"create {uid}: no DB answered: {'; '.join(errors)}")
    return DbError(f"create {uid}: refused by every DB: {'; '.join(errors)}")
