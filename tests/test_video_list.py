"""``GET /v1/videos`` on real proxies and DBs: the caller's videos only, paginated as the OpenAI
API does (the real ``openai`` package walks the pages), merged from every DB when no DB holds
them all, bad arguments refused naming the parameter; and the DB's ``list`` op, whose arguments
are checked before use, so no malformed request stops the DB loop."""

from __future__ import annotations

import random
import warnings

import pytest

import proxy_harness as H
from onepiece.db.listing import CreatedIndex
from onepiece.proxy.cluster import StaticCluster
from onepiece.proxy.keys import ApiKeys, new_key
from onepiece.proxy.server import ProxyServer
from onepiece.transport.rpc import RpcClient, RpcError

ALICE, BOB = new_key(), new_key()


@pytest.fixture(scope="module")
def h():
    harness = H.Harness(max_inflight=1000, keys=ApiKeys([ALICE, BOB]))
    yield harness
    harness.close()


def openai_client(url: str, key: str):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def test_openai_lists_the_callers_videos_page_by_page(h):
    alice, bob = openai_client(h.url, ALICE), openai_client(h.url, BOB)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        mine = [alice.videos.create(prompt=f"a cat {i}", model="t2v").id for i in range(7)]
        theirs = [bob.videos.create(prompt="a dog", model="t2v").id for _ in range(2)]

        page = alice.videos.list(limit=3)
        assert [v.id for v in page.data] == mine[::-1][:3] and page.has_more
        assert page.last_id == mine[-3] and page.model_extra["first_id"] == mine[-1]
        assert [v.id for v in alice.videos.list(limit=3)] == mine[::-1]  # auto-paging: all 7, newest first
        assert [v.id for v in alice.videos.list(limit=2, order="asc")] == mine
        assert [v.id for v in alice.videos.list(after=mine[2], order="asc", limit=100).data] == mine[3:]
        assert [v.id for v in bob.videos.list()] == theirs[::-1]
        last = alice.videos.list(after=mine[1], order="asc", limit=5)
        assert [v.id for v in last.data] == mine[2:7] and last.has_more is False
        assert alice.videos.list(after=mine[0], order="desc").data == []


def test_paging_goes_on_after_a_pages_last_video_is_deleted(h):
    """A client's cursor is the last id of the page it was given; that video may be deleted (or
    purged after its download) before it asks for the next page."""
    auth = {"Authorization": f"Bearer {BOB}"}
    mine = [h.http.post("/v1/videos", json={"prompt": f"p{i}"}, headers=auth).json()["id"] for i in range(4)]
    asc = [v["id"] for v in h.http.get("/v1/videos?order=asc&limit=100", headers=auth).json()["data"]]
    before = asc[:asc.index(mine[0])]  # the caller's earlier videos (other tests')
    first = h.http.get("/v1/videos?order=asc&limit=2" + (f"&after={before[-1]}" if before else ""), headers=auth).json()
    assert [v["id"] for v in first["data"]] == mine[:2]
    assert h.http.delete(f"/v1/videos/{first['last_id']}", headers=auth).status_code == 200
    assert h.http.get(f"/v1/videos/{first['last_id']}", headers=auth).status_code == 404
    rest = h.http.get(f"/v1/videos?order=asc&limit=2&after={first['last_id']}", headers=auth)
    assert rest.status_code == 200 and [v["id"] for v in rest.json()["data"]] == mine[2:], rest.text
    # a cursor this caller was never given is still looked up, and unknown: a 400
    r = h.http.get(f"/v1/videos?after={mine[1]}", headers={"Authorization": f"Bearer {ALICE}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "after"


def test_bad_list_arguments_are_a_400_naming_the_parameter(h):
    vid = h.http.post("/v1/videos", json={"prompt": "x"}, headers={"Authorization": f"Bearer {ALICE}"}).json()["id"]
    auth = {"Authorization": f"Bearer {ALICE}"}
    for query, param in (("limit=0", "limit"), ("limit=101", "limit"), ("limit=abc", "limit"), ("limit=-1", "limit"),
                         ("limit=%C2%B2", "limit"), ("order=up", "order"), ("after=nope", "after"),
                         ("after=video_" + "0" * 32, "after"), ("page=2", "page"), ("limit=1&limit=2", "limit")):
        r = h.http.get(f"/v1/videos?{query}", headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (query, r.text)
    # Another key's video is no cursor either: the same answer as an unknown one.
    r = h.http.get(f"/v1/videos?after={vid}", headers={"Authorization": f"Bearer {BOB}"})
    assert r.status_code == 400 and "unknown, expired or deleted" in r.json()["error"]["message"]


def test_without_keys_the_list_is_the_whole_sets_and_merges_dbs_that_each_hold_part():
    # Two DBs that do not replicate (replication 1 of 2): each holds the videos placed on it.
    dbs = [H.DbThread("db0"), H.DbThread("db1")]
    entrance = H.registry.listen("tcp://127.0.0.1:0")
    cluster = StaticCluster(H.WORKFLOW, db_list=[d.addresses for d in dbs], entrance_map={"t2v": [entrance.address]})
    proxy = ProxyServer(cluster, refresh_s=0.05)
    try:
        proxy.start()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            client = openai_client(proxy.url, "unused")
            made = [client.videos.create(prompt=f"v{i}", model="t2v").id for i in range(12)]
            held = [len(d.server.store) for d in dbs]
            assert sum(held) == 12 and all(held), held  # spread over both
            assert [v.id for v in client.videos.list(limit=5, order="asc")] == made
            assert [v.id for v in client.videos.list(limit=100)] == made[::-1]
    finally:
        proxy.stop()
        entrance.close()
        for d in dbs:
            d.close()


def test_the_db_list_op_checks_its_arguments_and_keeps_serving():
    db = H.DbThread()
    rpc = RpcClient(db.server.control_address, timeout=2.0, retries=0)
    try:
        for i in range(5):
            rpc.call("create", record={"uid": f"u{i}", "created_at": 100.0 + i, "owner": "o1" if i % 2 else "o2"})
        for bad in ({"limit": 0}, {"limit": 101}, {"limit": "5"}, {"limit": True}, {"order": "up"},
                    {"owner": 5}, {"owner": "x" * 65}, {"after": [True, "u1"]}, {"after": ["1", "u1"]},
                    {"after": [1.0]}, {"after": "u1"}, {"after": [float("inf"), "u1"]}, {"records": 1}):
            with pytest.raises(RpcError, match="list"):
                rpc.call("list", **bad)
        reply, _ = rpc.call("list", owner="o1", limit=1, order="asc")
        assert [r["uid"] for r in reply["records"]] == ["u1"] and reply["has_more"] is True
        reply, _ = rpc.call("list", owner="o1", limit=5, order="asc", after=[101.0, "u1"])
        assert [r["uid"] for r in reply["records"]] == ["u3"] and reply["has_more"] is False
        reply, _ = rpc.call("list", limit=100)
        assert [r["uid"] for r in reply["records"]] == ["u4", "u3", "u2", "u1", "u0"]
        assert all("trace" not in r for r in reply["records"])
        # An owner on get/content/delete is checked the same way; another owner's record is absent.
        for bad_owner in (5, "", "x" * 65):
            with pytest.raises(RpcError, match="owner"):
                rpc.call("get", uid="u1", owner=bad_owner)
        with pytest.raises(RpcError, match="not found"):
            rpc.call("get", uid="u1", owner="o2")
        with pytest.raises(RpcError, match="not found"):
            rpc.call("delete", uid="u1", owner="o2")
        assert rpc.call("get", uid="u1", owner="o1")[0]["record"]["uid"] == "u1"
        # Creates are checked too: an owner that is not a string never reaches the index.
        with pytest.raises(RpcError, match="owner"):
            rpc.call("create", record={"uid": "u9", "owner": 7})
    finally:
        rpc.close()
        db.close()


def test_the_created_index_pages_like_a_sorted_scan():
    rng = random.Random(7)
    index = CreatedIndex()
    live: dict[str, tuple[float, str | None]] = {}
    for step in range(3000):
        uid = f"u{rng.randrange(300)}"
        if rng.random() < 0.25:
            index.remove(uid)
            live.pop(uid, None)
        else:
            at, owner = float(rng.randrange(50)), rng.choice(["a", "b", None])
            index.put(uid, at, owner)
            live[uid] = (at, owner)
        if step % 100:
            continue
        for owner in (None, "a", "b"):
            keys = sorted((at, u) for u, (at, o) in live.items() if owner is None or o == owner)
            for descending in (False, True):
                want = keys[::-1] if descending else keys
                after = rng.choice(want) if want and rng.random() < 0.7 else None
                rest = want[want.index(after) + 1:] if after else want
                limit = rng.randrange(1, 20)
                uids, more = index.page(owner, after, limit, descending)
                assert uids == [u for _, u in rest[:limit]] and more == (len(rest) > limit)
