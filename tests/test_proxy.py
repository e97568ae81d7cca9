"""The proxy against real sockets: a real DbServer, a real ZMQ entrance receiver, the real
proxy (uvicorn + uvloop) on an ephemeral port, and real HTTP clients (httpx and the official
``openai`` package). The test plays the stages by writing status/result/failed messages to the
DB's data address, as a stage's ResultDeliver does."""

from __future__ import annotations

import base64
import re
import socket
import sys
import threading
import time
import warnings
from pathlib import Path

import httpx
import numpy as np
import pytest

from onepiece.proxy.errors import ApiError
from onepiece.proxy.server import ProxyServer
from onepiece.proxy.validation import build_job


import proxy_harness as H  # noqa: E402  (tests/ is on pytest's pythonpath)
WORKFLOW, Harness, png, wait_for, metric = H.WORKFLOW, H.Harness, H.png, H.wait_for, H.metric


@pytest.fixture(scope="module")
def h():
    harness = Harness(max_inflight=10_000, max_body_bytes=1 << 20)
    yield harness
    harness.close()


def recv_uid(h, uid: str, timeout: float = 5.0):
    """The entrance message for ``uid`` (earlier tests' messages are skipped)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = h.entrance.recv(0.2)
        if msg is not None and msg.uid == uid:
            return msg
    raise AssertionError(f"no message for {uid} at the entrance")


def uid_of(video: dict) -> str:
    assert video["id"].startswith("video_")
    return video["id"].removeprefix("video_")


# --- create ---------------------------------------------------------------------------------------
def test_create_json_builds_the_workflow_message_and_get_shows_queued(h):
    before = time.time_ns()
    r = h.create(prompt="a red fox", model="t2v", size="80x48", seconds=1, steps=3, guidance_scale=2.5, seed=7,
                 negative_prompt="blurry")
    assert r.status_code == 200, r.text
    v = r.json()
    assert v["object"] == "video" and v["model"] == "t2v" and v["status"] == "queued" and v["progress"] == 0
    assert v["size"] == "80x48" and v["seconds"] == "1" and v["prompt"] == "a red fox"
    assert abs(v["created_at"] - time.time()) < 5 and v["completed_at"] is None and v["error"] is None
    uid = uid_of(v)
    assert re.fullmatch(r"[0-9a-f]{32}", uid), uid

    msg = recv_uid(h, uid)
    hd = msg.header
    assert hd["app"] == "t2v" and hd["stage"] == "text_encode" and hd["set"] == "set0" and hd["kind"] == "task"
    assert before <= hd["ts"] <= time.time_ns()
    assert hd["deadline"] == hd["ts"] + int(WORKFLOW.applications["t2v"].limits.timeout_s * 1e9)
    assert hd["params"] == {"prompt": "a red fox", "negative_prompt": "blurry", "width": 80, "height": 48,
                            "num_frames": 17, "steps": 3, "guidance": 2.5, "seed": 7, "fps": 16,
                            "max_sequence_length": 64}
    assert [(t["stage"], t["event"]) for t in hd["trace"]] == [("proxy", "leave")]
    assert msg.parts == {}

    g = h.http.get(f"/v1/videos/{v['id']}")
    assert g.status_code == 200
    got = g.json()
    assert got["status"] == "queued" and got["progress"] == 0 and got["id"] == v["id"] and got["size"] == "80x48"
    assert h.http.get(f"/v1/videos/{uid}").json()["id"] == v["id"]  # the bare uid works too


def test_ids_are_32_hex_digits_and_unique(h):
    ids = [h.create(prompt=f"id {i}").json()["id"] for i in range(100)]
    uids = [uid_of({"id": i}) for i in ids]
    assert all(re.fullmatch(r"[0-9a-f]{32}", u) for u in uids), uids
    assert len(set(uids)) == len(uids)


def test_defaults_and_random_seed(h):
    r = h.create(prompt="defaults")
    assert r.status_code == 200, r.text
    p = recv_uid(h, uid_of(r.json())).header["params"]
    d = WORKFLOW.applications["t2v"].defaults
    assert (p["width"], p["height"], p["num_frames"], p["steps"], p["guidance"]) == \
        (d.width, d.height, d.num_frames, d.steps, d.guidance)
    assert 0 <= p["seed"] < 2**31 and r.json()["seconds"] == "0.5"


def test_create_multipart_image_reaches_the_entrance_as_is(h):
    image = png(40, 30)
    r = h.http.post("/v1/videos", data={"prompt": "it moves", "model": "i2v", "size": "64x64", "num_frames": "13",
                                        "seed": "5"},
                    files={"input_reference": ("ref.png", image, "image/png")})
    assert r.status_code == 200, r.text
    msg = recv_uid(h, uid_of(r.json()))
    assert msg.header["app"] == "i2v" and msg.header["stage"] == WORKFLOW.applications["i2v"].stages[0]
    assert msg.header["params"]["num_frames"] == 13 and msg.header["params"]["seed"] == 5
    img = msg.parts["image"]
    assert isinstance(img, np.ndarray) and img.dtype == np.uint8 and img.shape == (30, 40, 3)
    assert tuple(img[0, 0]) == (1, 2, 3) and tuple(img[10, 10]) == (200, 10, 30)
    assert r.json()["seconds"] == "0.75"


@pytest.mark.parametrize("encode", [
    lambda b: base64.b64encode(b).decode(),
    lambda b: "data:image/png;base64," + base64.b64encode(b).decode(),
    lambda b: {"image_url": "data:image/png;base64," + base64.b64encode(b).decode()},
])
def test_create_json_with_base64_image(h, encode):
    r = h.create(prompt="x", model="i2v", input_reference=encode(png(32, 16)))
    assert r.status_code == 200, r.text
    assert recv_uid(h, uid_of(r.json())).parts["image"].shape == (16, 32, 3)


def test_model_defaults_to_i2v_when_an_image_is_attached(h):
    r = h.http.post("/v1/videos", data={"prompt": "x"}, files={"input_reference": ("a.png", png(), "image/png")})
    assert r.status_code == 200 and r.json()["model"] == "i2v"


def test_seconds_to_frames_rule():
    def frames(**kw):
        return build_job(WORKFLOW, {"prompt": "p", **kw}, None).num_frames

    assert frames(seconds=1) == 17 and frames(seconds="2") == 33 and frames(seconds=0.01) == 1
    assert frames(seconds=5) == 81  # the app's limit
    with pytest.raises(ApiError) as e:  # beyond it: refused as an explicit frame count is, not cut short
        frames(seconds=60)
    assert e.value.param == "seconds" and "beyond the limit 81" in str(e.value) and "at most 5 s" in str(e.value)
    assert frames(seconds=1, num_frames=5) == 5  # an explicit frame count wins


# --- progress, result, download, delete ---------------------------------------------------------
def test_progress_completion_and_content(h):
    v = h.create(prompt="progress").json()
    uid = uid_of(v)
    h.db.progress(uid, 40, stage="denoise_t2v")
    got = wait_for(lambda: (r := h.http.get(f"/v1/videos/{v['id']}").json())["status"] == "in_progress" and r,
                   what="in_progress")
    assert got["progress"] == 40 and got["stage"] == "denoise_t2v"
    r = h.http.get(f"/v1/videos/{v['id']}/content")
    assert r.status_code == 409 and r.json()["error"]["code"] == "video_not_ready"

    mp4 = b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 10
    h.db.result(uid, mp4)
    done = wait_for(lambda: (r := h.http.get(f"/v1/videos/{v['id']}").json())["status"] == "completed" and r,
                    what="completed")
    assert done["progress"] == 100 and done["completed_at"] >= done["created_at"]
    assert done["expires_at"] > done["completed_at"] and done["error"] is None
    r = h.http.get(f"/v1/videos/{v['id']}/content")
    assert r.status_code == 200 and r.content == mp4 and r.headers["content-type"] == "video/mp4"
    # A retried download still finds it; the DB purges it purge_after_fetch_s (0.3 s here) later.
    assert h.http.get(f"/v1/videos/{v['id']}/content").status_code == 200
    wait_for(lambda: h.http.get(f"/v1/videos/{v['id']}/content").status_code == 404, timeout=5,
             what="the fetched result purged")


def test_failed_request_shows_its_error(h):
    v = h.create(prompt="doomed").json()
    h.db.failed(uid_of(v), "worker crashed: out of memory", stage="vae_decode")
    got = wait_for(lambda: (r := h.http.get(f"/v1/videos/{v['id']}").json())["status"] == "failed" and r,
                   what="failed")
    assert got["error"]["code"] == "generation_failed" and "out of memory" in got["error"]["message"]
    r = h.http.get(f"/v1/videos/{v['id']}/content")
    assert r.status_code == 409 and r.json()["error"]["code"] == "video_failed"
    # A result the DBs had no room for is not the model's failure: it says so in its code.
    v = h.create(prompt="too big").json()
    h.db.failed(uid_of(v), "store full: it needs 15706 bytes, 5186 of 300000 free", stage="vae_decode")
    got = wait_for(lambda: (r := h.http.get(f"/v1/videos/{v['id']}").json())["status"] == "failed" and r,
                   what="failed")
    assert got["error"]["code"] == "store_full"


def test_delete(h):
    v = h.create(prompt="delete me").json()
    r = h.http.delete(f"/v1/videos/{v['id']}")
    assert r.status_code == 200 and r.json() == {"id": v["id"], "object": "video.deleted", "deleted": True}
    assert h.http.get(f"/v1/videos/{v['id']}").status_code == 404
    assert h.http.delete(f"/v1/videos/{v['id']}").status_code == 404


# --- bad input ----------------------------------------------------------------------------------
def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _bomb() -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("1", (5000, 4000)).save(buf, "PNG")  # a few KB on the wire, 20 Mpx decoded
    return buf.getvalue()


BAD_JSON = [
    # (body, status, error code, param)
    (b"{", 400, "invalid_json", None),
    (b"[1, 2]", 400, "invalid_json", None),
    (b"", 400, "invalid_json", None),
    (b'{"model": "t2v"}', 400, "missing_required_parameter", "prompt"),
    (b'{"prompt": "   "}', 400, "invalid_value", "prompt"),
    (b'{"prompt": 12}', 400, "invalid_value", "prompt"),
    (b'{"prompt": "x", "model": "sora-2"}', 400, "model_not_found", "model"),
    (b'{"prompt": "x", "size": "65x64"}', 400, "invalid_value", "size"),
    (b'{"prompt": "x", "size": "0x64"}', 400, "invalid_value", "size"),
    (b'{"prompt": "x", "size": "1024x1024"}', 400, "invalid_value", "size"),
    (b'{"prompt": "x", "size": "big"}', 400, "invalid_value", "size"),
    ('{"prompt": "x", "size": "\uff16\uff14x\uff16\uff14"}'.encode(), 400, "invalid_value", "size"),  # full-width digits
    (b'{"prompt": "x", "seconds": -1}', 400, "invalid_value", "seconds"),
    (b'{"prompt": "x", "num_frames": 9, "seconds": 0}', 400, "invalid_value", "seconds"),  # checked though unused
    (b'{"prompt": "x", "seconds": "nan"}', 400, "invalid_value", "seconds"),
    (b'{"prompt": "x", "num_frames": 10}', 400, "invalid_value", "num_frames"),
    (b'{"prompt": "x", "num_frames": 85}', 400, "invalid_value", "num_frames"),
    (b'{"prompt": "x", "steps": 0}', 400, "invalid_value", "steps"),
    (b'{"prompt": "x", "steps": 1000}', 400, "invalid_value", "steps"),
    (b'{"prompt": "x", "steps": true}', 400, "invalid_value", "steps"),
    (b'{"prompt": "x", "steps": "many"}', 400, "invalid_value", "steps"),
    (b'{"prompt": "x", "steps": 4, "num_inference_steps": 5}', 400, "invalid_value", "num_inference_steps"),
    (b'{"prompt": "x", "guidance": -1}', 400, "invalid_value", "guidance"),
    (b'{"prompt": "x", "seed": -5}', 400, "invalid_value", "seed"),
    (b'{"prompt": "x", "timeout_s": 100000}', 400, "invalid_value", "timeout_s"),
    (b'{"prompt": "x", "slo_s": 0}', 400, "invalid_value", "slo_s"),
    (b'{"prompt": "x", "slo_s": 5, "timeout_s": 4}', 400, "invalid_value", "slo_s"),
    (b'{"prompt": "x", "slo_s": true}', 400, "invalid_value", "slo_s"),
    (b'{"prompt": "x", "stepz": 3}', 400, "unknown_parameter", "stepz"),
    (b'{"prompt": "x", "model": "i2v"}', 400, "missing_input_reference", "input_reference"),
    (('{"prompt": "x", "model": "t2v", "input_reference": "%s"}' % _b64(png())).encode(), 400,
     "unexpected_input_reference", "input_reference"),
    (b'{"prompt": "x", "model": "i2v", "input_reference": "not base64!!"}', 400, "invalid_base64", "input_reference"),
    (b'{"prompt": "x", "model": "i2v", "input_reference": "data:image/png;base64,@@@"}', 400, "invalid_base64",
     "input_reference"),
    (('{"prompt": "x", "model": "i2v", "input_reference": "%s"}' % _b64(b"plain text")).encode(), 400,
     "invalid_image", "input_reference"),
    (('{"prompt": "x", "model": "i2v", "input_reference": "%s"}' % _b64(png()[:60])).encode(), 400,
     "invalid_image", "input_reference"),
    (('{"prompt": "x", "model": "i2v", "input_reference": "%s"}' % _b64(_bomb())).encode(), 400,
     "image_too_large", "input_reference"),
    (b'{"prompt": "x", "model": "i2v", "input_reference": "https://example.com/a.png"}', 400,
     "unsupported_reference", "input_reference"),
    (b'{"prompt": "x", "model": "i2v", "input_reference": {"file_id": "file_1"}}', 400, "unsupported_reference",
     "input_reference"),
    (b'{"prompt": "x", "model": "i2v", "input_reference": 5}', 400, "invalid_value", "input_reference"),
    (('{"prompt": "%s"}' % ("x" * 5000)).encode(), 400, "invalid_value", "prompt"),
]


@pytest.mark.parametrize("body,status,code,param", BAD_JSON, ids=[str(i) for i in range(len(BAD_JSON))])
def test_bad_json_input_is_a_clear_4xx(h, body, status, code, param):
    r = h.http.post("/v1/videos", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["param"] == param and err["message"] and err["type"]


def _png_bomb(width: int, height: int) -> bytes:
    """A valid 1-bit PNG of ``width`` x ``height`` zeros: tens of KB that decode to gigabytes."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    z = zlib.compressobj(9)
    row = b"\x00" * (1 + (width + 7) // 8)  # filter byte + packed bits
    idat = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


@pytest.mark.parametrize("side", [5000, 30_000])  # over our bound; over PIL's own bomb bound too
def test_a_decompression_bomb_is_refused_without_decoding(h, side):
    bomb = _png_bomb(side, side)
    assert len(bomb) < 200_000
    t0 = time.perf_counter()
    r = h.http.post("/v1/videos", data={"prompt": "x", "model": "i2v", "size": "64x64"},
                    files={"input_reference": ("bomb.png", bomb, "image/png")})
    took = time.perf_counter() - t0
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "image_too_large" and err["param"] == "input_reference" and "pixels" in err["message"]
    assert took < 1.0, took  # decoding 0.9 Gpx would take seconds and gigabytes
    assert h.healthz()["status"] == "ok"


def test_an_image_of_extreme_proportions_is_refused_from_its_header(h):
    """A 1x262144 strip is 842 bytes of PNG and within the pixel bound, but CLIP's processor
    scales its short side up and its long side with it: the image_encode worker went to 3 GB.
    Sides further apart than MAX_IMAGE_ASPECT are refused before admission, and a stage refuses
    them too (what reaches it by any path)."""
    from onepiece.config import MAX_IMAGE_ASPECT
    from onepiece.proxy.images import check_image
    from onepiece.stage.registry import lookup
    from onepiece.transport.message import Message

    strip = _png_bomb(1, 262_144)
    assert len(strip) < 2000
    r = h.http.post("/v1/videos", data={"prompt": "x", "model": "i2v", "size": "64x64"},
                    files={"input_reference": ("strip.png", strip, "image/png")})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_image" and "1x262144" in err["message"] and f"{MAX_IMAGE_ASPECT}:1" in err["message"]
    check_image(_png_bomb(MAX_IMAGE_ASPECT, 1))  # at the bound: accepted
    check_image(_png_bomb(1, MAX_IMAGE_ASPECT))
    with pytest.raises(ValueError, match=f"differ more than {MAX_IMAGE_ASPECT}:1"):
        lookup("image_encode", "i2v")(None, Message({"uid": "u"}, {"image": np.zeros((1, 65, 3), np.uint8)}))


def _noise(w: int, h: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _photo(w: int, h: int) -> np.ndarray:
    """Smooth gradients: a large image that still fits the test proxy's 1 MiB body as PNG."""
    y, x = np.mgrid[0:h, 0:w]
    return np.stack([x * 255 // w, y * 255 // h, (x + y) % 256], axis=-1).astype(np.uint8)


def _encode(arr: np.ndarray, fmt: str = "PNG", **save: object) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, fmt, **save)
    return buf.getvalue()


@pytest.mark.parametrize("w, h_, fmt, orientation, want", [
    (1024, 1024, "PNG", None, (64, 64)),
    (1600, 1200, "PNG", None, (64, 85)),  # the aspect ratio kept: covers 64x64 for the VAE and CLIP
    (1200, 1600, "JPEG", 6, (64, 85)),  # stored portrait, shown landscape (EXIF): reduced upright
    (48, 40, "PNG", None, (40, 48)),  # smaller than the request: as is (the stage scales it up)
])
def test_a_large_image_leaves_the_proxy_at_the_requests_size(h, w, h_, fmt, orientation, want):
    from PIL import Image

    save = {}
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        save["exif"] = exif
    r = h.http.post("/v1/videos", data={"prompt": "x", "model": "i2v", "size": "64x64"},
                    files={"input_reference": ("a", _encode(_photo(w, h_), fmt, **save), f"image/{fmt.lower()}")})
    assert r.status_code == 200, r.text
    img = recv_uid(h, uid_of(r.json())).parts["image"]
    assert img.dtype == np.uint8 and img.shape == (*want, 3)


def test_an_image_at_the_requests_size_reaches_the_stages_unchanged(h):
    """Byte for byte the uploaded pixels: what the i2v stages compute from it cannot change."""
    pixels = _noise(96, 64, seed=3)
    r = h.http.post("/v1/videos", data={"prompt": "x", "model": "i2v", "size": "96x64"},
                    files={"input_reference": ("a.png", _encode(pixels), "image/png")})
    assert r.status_code == 200, r.text
    img = recv_uid(h, uid_of(r.json())).parts["image"]
    assert img.shape == pixels.shape and np.array_equal(img, pixels)


def test_cover_size():
    from onepiece.proxy.images import cover_size

    assert cover_size(1600, 1200, 64, 64) == (85, 64)
    assert cover_size(1200, 1600, 832, 480) == (832, 1109)
    assert cover_size(100, 100, 832, 480) == (100, 100)
    assert cover_size(832, 480, 832, 480) == (832, 480)
    assert cover_size(4000, 10, 64, 64) == (4000, 10)  # never scaled up


def test_an_image_in_a_format_that_runs_a_program_is_refused_unopened(tmp_path, monkeypatch):
    """PostScript (EPS) is a program Pillow hands to Ghostscript: a client's upload must never
    reach it. A stand-in ``gs`` first on PATH records whether anything ran it."""
    from onepiece.proxy.images import decode_image

    ran = tmp_path / "gs-ran"
    gs = tmp_path / "bin" / "gs"
    gs.parent.mkdir()
    gs.write_text(f"#!/bin/sh\ntouch {ran}\nexit 1\n")
    gs.chmod(0o755)
    monkeypatch.setenv("PATH", f"{gs.parent}:{__import__('os').environ['PATH']}")
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 64 64\nshowpage\n"
    with pytest.raises(ApiError) as e:
        decode_image(eps, (64, 64))
    assert e.value.status == 400 and e.value.code == "invalid_image" and "PNG" in e.value.message
    assert not ran.exists()
    assert decode_image(png(), (64, 64)).shape[2] == 3  # what images are for still decodes


def test_a_photo_with_an_exif_tag_of_the_wrong_type_is_turned_upright():
    """Pillow's exif_transpose also writes the EXIF block again without the orientation, and
    packing a value of a type its tag does not take raised struct.error: a 500 for a photo whose
    pixels were fine. Only its pixels travel on, turned as its orientation says."""
    import io

    from PIL import Image

    from onepiece.proxy.images import decode_image

    exif = Image.Exif()
    exif[0x0112] = 6  # shown turned 90 degrees clockwise
    exif[0x010F] = "cam"  # Make, ASCII
    data = _encode(_photo(48, 32), "JPEG", exif=exif)
    # Its Make entry relabelled PlanarConfiguration, a SHORT tag, keeping its ASCII value.
    data = data.replace(b"\x01\x0f\x00\x02", b"\x01\x1c\x00\x02", 1)
    assert Image.open(io.BytesIO(data)).getexif()[0x011C] == "cam"
    got = decode_image(data, (32, 48))
    assert got.shape == (48, 32, 3)


@pytest.mark.parametrize("fmt", ["PNG", "TIFF"])
def test_a_16_bit_grey_image_keeps_its_tones(fmt):
    """Pillow opens 16-bit grey as mode I;16, and its conversion to RGB clips every sample at 255:
    a mid-grey 16-bit PNG reached the stages white. Its 8-bit image is the high byte of each
    sample, as Pillow makes of 16-bit RGB."""
    from onepiece.proxy.images import decode_image

    grey = np.arange(64 * 48, dtype=np.uint16).reshape(48, 64) * 21  # 0 .. 64491
    got = decode_image(_encode(grey, fmt), (64, 48))
    assert got.shape == (48, 64, 3) and got.dtype == np.uint8
    want = (grey >> 8).astype(np.uint8)
    for c in range(3):
        assert np.array_equal(got[..., c], want)


def _icon(png: bytes) -> bytes:
    """An icon file whose one entry says 256x256 and holds ``png``, whatever its size."""
    import struct

    return struct.pack("<HHH", 0, 1, 1) + struct.pack("<BBBBHHII", 0, 0, 0, 0, 1, 32, len(png), 22) + png


def test_checking_an_image_decodes_no_pixel_in_any_accepted_format(monkeypatch):
    """``check_image`` runs on the proxy's event loop, before admission: it may read headers only.
    Pillow's ICO opener decodes the icon's image as it opens it, so a 340 KB icon around a
    9400x9400 PNG held the loop for 0.9 s and 350 MB before it was refused as too large."""
    from PIL import Image

    from onepiece.proxy.images import FORMATS, check_image

    samples = {fmt: _encode(_noise(40, 30), fmt) for fmt in FORMATS}
    bomb = _icon(_png_bomb(5000, 5000))

    def decoder(*args, **kwargs):
        raise AssertionError("a pixel was decoded")

    monkeypatch.setattr(Image, "_getdecoder", decoder)
    for fmt, data in samples.items():
        check_image(data)  # no AssertionError: nothing decoded
    with pytest.raises(ApiError) as e:
        check_image(bomb)
    assert e.value.status == 400 and e.value.code == "invalid_image"


def test_bad_form_input_is_a_clear_4xx(h):
    cases = [
        ({"prompt": "x", "model": "i2v"}, {"input_reference": ("a.txt", b"hello", "text/plain")}, "invalid_image"),
        ({"prompt": "x", "model": "i2v"}, {"input_reference": ("a.bin", b"\x00" * 100, "application/octet-stream")},
         "invalid_image"),
        ({"prompt": "x", "model": "i2v"}, {"input_reference": ("a.png", b"", "image/png")}, "invalid_image"),
        ({"prompt": "x", "model": "i2v"}, {"other": ("a.png", png(), "image/png")}, "invalid_value"),
        ({"prompt": "x", "size": "64x63"}, None, "invalid_value"),
        ({"model": "t2v"}, None, "missing_required_parameter"),
    ]
    for data, files, code in cases:
        r = h.http.post("/v1/videos", data=data, files=files)
        assert r.status_code == 400, (data, r.text)
        assert r.json()["error"]["code"] == code, (data, r.json())
    # multipart without a boundary, and a content type we do not take
    r = h.http.post("/v1/videos", content=b"junk", headers={"content-type": "multipart/form-data"})
    assert r.status_code == 400 and r.json()["error"]["message"]
    r = h.http.post("/v1/videos", content=b"prompt=x", headers={"content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"


def test_oversized_bodies_get_413(h):
    big = b'{"prompt": "' + b"x" * (2 << 20) + b'"}'
    r = h.http.post("/v1/videos", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the streamed size is what counts
        for _ in range(40):
            yield b"x" * 65536

    r = h.http.post("/v1/videos", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = h.http.post("/v1/videos", data={"prompt": "x", "model": "i2v"},
                    files={"input_reference": ("a.png", b"\x89PNG" + b"\x00" * (2 << 20), "image/png")})
    assert r.status_code == 413


def test_unknown_ids_are_404(h):
    for vid in ("video_" + "0" * 32, "0" * 32, "nope", "video_../../etc", "x" * 500):
        for method, suffix in (("GET", ""), ("GET", "/content"), ("DELETE", "")):
            r = h.http.request(method, f"/v1/videos/{vid}{suffix}")
            assert r.status_code == 404, (method, vid, r.text)
            assert r.json()["error"]["code"] in ("video_not_found", "not_found")
    assert h.http.get("/v1/nothing").status_code == 404
    assert h.http.get(f"/v1/videos/{'0' * 32}/content", params={"variant": "thumbnail"}).status_code == 400


def test_garbage_never_crashes_the_proxy(h):
    rng = np.random.default_rng(0)
    for i in range(30):
        body = rng.integers(0, 256, int(rng.integers(0, 3000)), dtype=np.uint8).tobytes()
        ctype = ["application/json", "multipart/form-data; boundary=abc", "application/x-www-form-urlencoded",
                 "", "image/png"][i % 5]
        r = h.http.post("/v1/videos", content=body, headers={"content-type": ctype})
        assert 400 <= r.status_code < 500, (ctype, r.status_code, r.text)
        assert "error" in r.json()
    # Malformed HTTP on a raw socket.
    host, port = h.url.removeprefix("http://").rsplit(":", 1)
    for junk in (b"GARBAGE\r\n\r\n", b"POST /v1/videos HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
                 b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + b"\x00" * 64):
        with socket.create_connection((host, int(port)), timeout=2) as s:
            s.sendall(junk)
            s.settimeout(2)
            try:
                s.recv(1024)
            except (socket.timeout, ConnectionResetError):
                pass
    assert h.healthz()["status"] == "ok"


def test_healthz_and_metrics(h):
    hz = h.healthz()
    assert hz["dbs"] == 1 and hz["entrances"] == {"t2v": 1, "i2v": 1} and hz["max_inflight"] == 10_000
    h.create(prompt="x", size="1x1")
    text = h.http.get("/metrics").text
    assert 'onepiece_proxy_requests_total{code="400",endpoint="/v1/videos",method="POST"}' in text
    assert 'onepiece_proxy_rejected_total{reason="invalid_value"}' in text
    assert "onepiece_proxy_accepted_total" in text and "onepiece_proxy_inflight" in text
    assert "onepiece_proxy_submit_seconds_bucket" in text
    models = h.http.get("/v1/models").json()
    assert {m["id"] for m in models["data"]} == {"t2v", "i2v"}


def test_openapi_schema_is_served(h):
    r = h.http.get("/openapi.json")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    schema = r.json()
    assert {"/v1/videos", "/v1/videos/{video_id}", "/v1/videos/{video_id}/content", "/v1/models",
            "/healthz"} <= set(schema["paths"])
    assert set(schema["paths"]["/v1/videos/{video_id}"]) == {"get", "delete"}
    assert set(schema["paths"]["/v1/videos"]) == {"get", "post"}
    body = schema["paths"]["/v1/videos"]["post"]["requestBody"]["content"]
    assert body["application/json"]["schema"]["required"] == ["prompt"]
    assert {"prompt", "size", "seconds", "input_reference"} <= set(body["application/json"]["schema"]["properties"])
    assert body["multipart/form-data"]["schema"]["properties"]["input_reference"]["format"] == "binary"
    assert "securitySchemes" not in schema.get("components", {})  # a loopback proxy without keys asks for none


@pytest.mark.parametrize("method, path, allow", [
    ("PUT", "/v1/videos", "GET, POST"),
    ("DELETE", "/v1/videos", "GET, POST"),
    ("POST", f"/v1/videos/video_{'0' * 32}", "DELETE, GET"),  # two routes share the path
    ("DELETE", "/healthz", "GET"),
    ("POST", "/openapi.json", "GET, HEAD"),  # Starlette serves HEAD for its GET routes
])
def test_a_wrong_method_gets_405_with_allow(h, method, path, allow):
    r = h.http.request(method, path)
    assert r.status_code == 405, r.text
    assert r.headers["allow"] == allow
    err = r.json()["error"]
    assert err["code"] == "method_not_allowed" and method in err["message"] and allow in err["message"]


def test_heartbeat_stats_count_accepted_and_rejected():
    from onepiece.status import render

    h = Harness(max_inflight=1)
    try:
        state = h.proxy.app.state.proxy
        assert state.stats() == {"inflight": 0, "max_inflight": 1, "accepted": 0, "rejected": 0, "refused": 0,
                                 "ended": {}}
        a = h.create(prompt="a")
        assert a.status_code == 200
        assert h.create(prompt="b").status_code == 429  # full
        assert h.create(prompt="c", size="1x1").status_code == 400  # invalid
        stats = state.stats()
        assert stats == {"inflight": 1, "max_inflight": 1, "accepted": 1, "rejected": 2, "refused": 1, "ended": {}}
        assert h.http.delete(f"/v1/videos/{a.json()['id']}").status_code == 200
        stats = state.stats()
        assert stats["inflight"] == 0 and stats["ended"] == {"cancelled": 1}
        proxy = {"id": "proxy0", "role": "proxy", "ready": True, "silent_s": 0.1, "stats": stats,
                 "addresses": {"http": h.url}}
        line = render({"sets": {"set0": {"stages": {}, "idle": [], "dbs": [], "proxies": [proxy]}}})
        # the 429 (a full set) told apart from the 400 (a bad request): different alarms
        assert "inflight 0/1 accepted 1 rejected 2 (1 for capacity) cancelled 1" in line
        # A stage counts the instances assigned to it now (a move changes them), not the topology's.
        moved = {"id": "stage-1", "role": "stage", "ready": True, "silent_s": 0.1, "stats": {}, "stage": "vae_decode",
                 "addresses": {"data": "tcp://127.0.0.1:1"}}
        text = render({"sets": {"set0": {"stages": {"vae_decode": {"want": 1, "instances": [moved, moved]},
                                                    "text_encode": {"want": 1, "instances": []}},
                                         "idle": [], "dbs": [], "proxies": []}}})
        assert "stage vae_decode: 2/2 ready (the topology starts 1)" in text
        # A DB (or proxy) that is gone is said so, as a stage's instance is: the list was just shorter.
        db = {"id": "set0-db1", "role": "db", "ready": True, "silent_s": 0.1, "stats": {},
              "addresses": {"data": "tcp://127.0.0.1:2"}}
        gone = render({"sets": {"set0": {"stages": {}, "idle": [], "dbs": [db], "proxies": [proxy],
                                         "want": {"dbs": 2, "proxies": 1}}}})
        assert "  dbs: 1/1 ready (the topology starts 2)" in gone and "  proxies: 1/1 ready\n" in gone
        assert "stage text_encode: 0/0 ready (the topology starts 1)" in text
    finally:
        h.close()


@pytest.mark.parametrize("error, code", [("full", "db_full"), ("refused", "db_unavailable"),
                                         ("unavailable", "db_unavailable")])
def test_db_errors_on_create_are_503_and_free_the_slot(h, monkeypatch, caplog, error, code):
    from onepiece.db.client import DbError, DbFull, DbUnavailable

    # What a DB error says names the DBs' addresses: the client is told its kind, the log the rest.
    exc = {"full": DbFull, "refused": DbError, "unavailable": DbUnavailable}[error](
        f"create: ipc:///run/onepiece/set0-db0.sock: {error}")

    async def create(record):
        raise exc

    state = h.proxy.app.state.proxy
    monkeypatch.setattr(state.dbs, "create", create)
    before = h.healthz()["inflight"]
    r = h.create(prompt="x")
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    message = r.json()["error"]["message"]
    assert r.json()["error"]["code"] == code and "ipc://" not in message and "db0" not in message
    assert message.startswith("the request could not be stored: ") and {
        "full": "every result store is full", "refused": "refused", "unavailable": "no result store answered"}[
        error] in message
    assert any("set0-db0.sock" in r.getMessage() for r in caplog.records)
    assert h.healthz()["inflight"] == before


def test_a_create_whose_video_would_not_fit_the_db_is_refused_at_once():
    """The DB holds room for each running request's video, sized from its ``size`` and
    ``seconds``, which the proxy records as the API's string ("0.5"): a create that would not
    fit is a 503 db_full at once, not accepted, served by every stage and then failed store_full."""
    h = Harness(max_inflight=100, db_max_bytes=200_000)
    try:
        first = h.create(size="64x64", num_frames=9).json()
        assert first["seconds"] == "0.5"
        h.db.result(uid_of(first), b"v" * 40_000)  # the DB learns: 64x64 for 0.5 s is 40 kB
        wait_for(lambda: h.http.get(f"/v1/videos/{first['id']}").json()["status"] == "completed", what="completed")
        assert h.http.delete(f"/v1/videos/{first['id']}").status_code == 200
        codes = [h.create(size="64x64", num_frames=9).status_code for _ in range(5)]
        assert codes == [200, 200, 200, 200, 503]  # 4 x 40 kB held, under 95% of 200 kB with the records
        r = h.create(size="64x64", num_frames=9)
        assert r.status_code == 503 and r.json()["error"]["code"] == "db_full"
        assert h.create(size="16x16", num_frames=9).status_code == 200  # 2.5 kB: still fits
    finally:
        h.close()


# --- admission ------------------------------------------------------------------------------------
def test_full_set_gets_429_and_capacity_returns_on_done():
    h = Harness(max_inflight=2)
    try:
        a, b = h.create(prompt="a").json(), h.create(prompt="b").json()
        r = h.create(prompt="c")
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "inflight_full" and "full" in r.json()["error"]["message"]
        assert h.healthz()["inflight"] == 2
        h.db.result(uid_of(a), b"mp4")  # the DB publishes `done`; the proxy frees a's slot
        wait_for(lambda: h.healthz()["inflight"] == 1, what="slot freed by the done event")
        assert h.create(prompt="c").status_code == 200
        assert h.create(prompt="d").status_code == 429
        h.db.failed(uid_of(b), "boom")  # failures free slots too
        wait_for(lambda: h.create(prompt="d").status_code == 200, what="slot freed by a failure")
        assert 'onepiece_proxy_rejected_total{reason="inflight_full"}' in h.http.get("/metrics").text
    finally:
        h.close()


def test_a_delete_through_another_proxy_frees_the_slot_on_the_proxy_that_admitted_it():
    """A set's proxies share its DBs, and a client (or a load balancer) may delete through any
    of them: the DB's cancel event frees the slot on the proxy that admitted the request, so an
    idle set does not refuse every create there until the deleted requests' deadlines."""
    h = Harness(max_inflight=2)
    other = ProxyServer(h.cluster, max_inflight=2, refresh_s=0.05)
    other.start()
    try:
        a, b = h.create(prompt="a").json(), h.create(prompt="b").json()
        assert h.create(prompt="c").status_code == 429
        with httpx.Client(base_url=other.url, timeout=10.0) as http:
            for v in (a, b):
                assert http.delete(f"/v1/videos/{v['id']}").status_code == 200
        wait_for(lambda: h.healthz()["inflight"] == 0, what="the slots freed by the cancel events")
        assert h.create(prompt="c").status_code == 200
    finally:
        other.stop()
        h.close()


def test_a_file_that_is_no_image_gets_400_even_from_a_full_set():
    """A request that can never succeed is told so, not refused with 429 as if the set were
    busy (its client would retry it for ever): the image's header is read before admission."""
    h = Harness(max_inflight=1)
    try:
        assert h.create(prompt="a").status_code == 200  # the set is full now
        r = h.http.post("/v1/videos", content=('{"prompt": "x", "model": "i2v", "input_reference": "%s"}'
                                               % _b64(b"plain text")).encode(),
                        headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_image", r.text
        assert h.create(prompt="b").json()["error"]["code"] == "inflight_full"
    finally:
        h.close()


def test_deadline_frees_the_slot_and_fails_the_request():
    h = Harness(max_inflight=1)
    try:
        v = h.create(prompt="slow", timeout_s=0.3).json()
        assert h.create(prompt="next").status_code == 429
        wait_for(lambda: h.create(prompt="next").status_code == 200, what="slot freed at the deadline")
        got = wait_for(lambda: (r := h.http.get(f"/v1/videos/{v['id']}").json())["status"] == "failed" and r,
                       what="DB deadline sweep")
        assert "deadline" in got["error"]["message"]
    finally:
        h.close()


# --- the request monitor: capacity and deadline admission (views as the NM sends them) -------------
def capacity_view(denoise_s: float = 0.5, denoise_workers: int = 1, queue: int = 0, proxies: int = 1) -> dict:
    """A monitor view of a t2v set limited by denoise_t2v: capacity denoise_workers/denoise_s."""
    from onepiece.nm.capacity import estimate

    def stage(name: str, t: float, workers: int = 1, queue: int = 0) -> dict:
        return {"role": "stage", "stage": name, "ready": True,
                "stats": {"ready": workers, "queue": queue, "service": {"t2v": {"mean_s": t, "recent": 10}}}}

    members = [stage("text_encode", 0.01), stage("denoise_t2v", denoise_s, denoise_workers, queue),
               stage("vae_decode", 0.05)]
    return {"apps": estimate(WORKFLOW, members), "proxies": proxies}


def drain(h) -> int:
    n = 0
    while h.entrance.recv(0.05) is not None:
        n += 1
    return n


def test_over_capacity_gets_a_steady_share_of_429s_with_retry_after():
    h = Harness(max_inflight=10_000)
    try:
        h.cluster.monitor_view = capacity_view(denoise_s=0.5)  # the set does 2 requests/s
        # admitted at the default headroom: 0.9 x 2/s (what /healthz and /metrics say too)
        wait_for(lambda: h.healthz()["admission"]["apps"]["t2v"]["rate"] == pytest.approx(1.8),
                 what="the proxy to take the view")
        start, results = time.monotonic(), []
        for i in range(40):  # 20/s for 2 s, ten times the capacity
            time.sleep(max(0.0, start + i * 0.05 - time.monotonic()))
            # Patient clients (nothing completes here, so the queue only grows): the rate decides.
            results.append((time.monotonic() - start, h.create(prompt=f"p{i}", timeout_s=60)))
        ok = [t for t, r in results if r.status_code == 200]
        refused = [r for _, r in results if r.status_code != 200]
        # a burst of 1 (max(1, 1.8/s × 0.5 s)) then 1.8/s: about 1 + 1.8 × 2 s (the run's own
        # length: creates that go through the pipeline's hand-over may stretch it)
        assert 3 <= len(ok) <= 2 + 1.8 * results[-1][0], [t for t in ok]
        assert ok[-1] > 1.0  # steady: admitted through the run, not one burst and then nothing
        for r in refused:
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            err = r.json()["error"]
            assert err["code"] == "over_capacity" and err["type"] == "rate_limit_error"
            assert "capacity" in err["message"] and "2.00 requests/s" in err["message"]
        assert drain(h) == len(ok)  # refused requests never reached the pipeline
        text = h.http.get("/metrics").text
        assert metric(text, "onepiece_proxy_rejected_total", reason="over_capacity") == len(refused)
        assert metric(text, "onepiece_proxy_accepted_total", app="t2v") == len(ok)
        assert metric(text, "onepiece_proxy_capacity", set="set0", app="t2v") == pytest.approx(2.0)
        assert metric(text, "onepiece_proxy_admit_rate", set="set0", app="t2v") == pytest.approx(1.8)
        assert metric(text, "onepiece_proxy_stage_service_seconds", app="t2v",
                      stage="denoise_t2v") == pytest.approx(0.5)
        assert metric(text, "onepiece_proxy_stage_rate", app="t2v", stage="denoise_t2v") == pytest.approx(2.0)
        assert metric(text, "onepiece_proxy_bottleneck", app="t2v", stage="denoise_t2v") == 1.0
        assert metric(text, "onepiece_proxy_monitor_enabled") == 1.0

        # two proxies in the set: this one admits half
        h.cluster.monitor_view = capacity_view(denoise_s=0.5, proxies=2)
        wait_for(lambda: h.healthz()["admission"]["apps"]["t2v"]["rate"] == pytest.approx(0.9),
                 what="re-rated to a fair share")
        assert metric(h.http.get("/metrics").text, "onepiece_proxy_admit_rate", app="t2v") == pytest.approx(0.9)
    finally:
        h.close()


def test_retry_after_says_when_the_next_token_comes():
    h = Harness(max_inflight=10_000)
    try:
        h.cluster.monitor_view = capacity_view(denoise_s=4.0)  # admits 0.9 × 0.25/s: a token every 4.4 s
        assert h.create(prompt="a").status_code == 200
        r = h.create(prompt="b")
        assert r.status_code == 429 and r.json()["error"]["code"] == "over_capacity"
        assert int(r.headers["retry-after"]) in (4, 5)
    finally:
        h.close()


def test_no_workers_at_a_stage_is_no_capacity():
    h = Harness(max_inflight=10_000)
    try:
        h.cluster.monitor_view = capacity_view(denoise_workers=0)
        r = h.create(prompt="a")
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "no_capacity" and "denoise_t2v" in r.json()["error"]["message"]
        assert drain(h) == 0
        h.cluster.monitor_view = capacity_view(denoise_workers=1)  # a worker is back
        assert h.create(prompt="a").status_code == 200
        assert metric(h.http.get("/metrics").text, "onepiece_proxy_rejected_total", reason="no_capacity") == 1
    finally:
        h.close()


def test_predicted_completion_past_the_deadline_is_refused():
    h = Harness(max_inflight=10_000)
    try:
        # 6 requests queue at denoise (0.5 s, 1 worker): predicted 0.01 + 0.5 × 7 + 0.05 = 3.56 s
        h.cluster.monitor_view = capacity_view(denoise_s=0.5, queue=6)
        r = h.create(prompt="a", timeout_s=2)
        assert r.status_code == 429 and r.json()["error"]["code"] == "deadline"
        assert r.headers["retry-after"] == "2"  # 1.56 s too late
        assert "3.56s" in r.json()["error"]["message"]
        # no deadline given: 5 × the standalone 0.56 s = 2.8 s, still too late
        r = h.create(prompt="b")
        assert r.status_code == 429 and r.json()["error"]["code"] == "deadline"
        # a client that can wait is admitted
        assert h.create(prompt="c", timeout_s=10).status_code == 200
        assert drain(h) == 1
        assert metric(h.http.get("/metrics").text, "onepiece_proxy_rejected_total", reason="deadline") == 2
    finally:
        h.close()


def test_requests_in_flight_here_count_as_the_queue_before_the_nm_sees_it():
    """A burst: the NM's view still shows empty queues, but the proxy's own in-flight count
    predicts the queue (n + 1 requests leave at the capacity C: the last after (n + 1) / C),
    so a request that would miss its 0.6 s deadline is refused; a completion frees room."""
    h = Harness(max_inflight=10_000, burst_s=5.0)  # a burst of 5 s: the bucket refuses none here
    try:
        view = capacity_view(denoise_s=0.5, denoise_workers=20)
        cap = view["apps"]["t2v"]["capacity"]  # ≈ 18.3/s, vae_decode's share for t2v
        fits = int(0.6 * cap)  # n + 1 ≤ 0.6 × C
        h.cluster.monitor_view = view
        uids = [uid_of(r.json()) for r in (h.create(prompt=f"p{i}", timeout_s=0.6) for i in range(fits))
                if r.status_code == 200]
        assert len(uids) == fits
        r = h.create(prompt="late", timeout_s=0.6)
        assert r.status_code == 429 and r.json()["error"]["code"] == "deadline", r.text
        # (fits + 1) / C is a hair past 0.6 s: shown to the digit that tells it from the deadline
        shown = re.search(r"predicted completion in ([0-9.]+)s exceeds the deadline of ([0-9.]+)s",
                          r.json()["error"]["message"])
        assert shown and float(shown[1]) == pytest.approx((fits + 1) / cap) and shown[1] != shown[2], r.text
        assert h.create(prompt="patient", timeout_s=5).status_code == 200  # may wait: admitted
        h.db.result(uids[0], b"mp4")
        h.db.result(uids[1], b"mp4")
        wait_for(lambda: h.healthz()["inflight"] == fits - 1, what="two slots freed by done events")
        assert h.create(prompt="now", timeout_s=0.6).status_code == 200
        assert drain(h) == fits + 2
    finally:
        h.close()


def test_monitor_off_admits_by_the_inflight_cap_only():
    h = Harness(max_inflight=2, monitor=False)
    try:
        h.cluster.monitor_view = capacity_view(denoise_workers=0)
        assert h.create(prompt="a").status_code == 200 and h.create(prompt="b").status_code == 200
        r = h.create(prompt="c")
        assert r.status_code == 429 and r.json()["error"]["code"] == "inflight_full"
        assert h.healthz()["admission"] == {"enabled": False, "proxies": None, "apps": {}}
        text = h.http.get("/metrics").text
        assert metric(text, "onepiece_proxy_monitor_enabled") == 0.0
        assert metric(text, "onepiece_proxy_capacity", app="t2v") is None
    finally:
        h.close()


def test_a_refusal_is_decided_in_microseconds_without_io():
    """The whole refusal path after the HTTP body is read (validation, the monitor's check,
    the error), timed in process: far under a millisecond."""
    from onepiece.proxy.validation import build_job

    h = Harness(max_inflight=10_000)
    try:
        st = h.proxy.app.state.proxy
        h.cluster.monitor_view = capacity_view(denoise_s=100.0)  # 0.01/s
        assert h.create(prompt="first").status_code == 200  # takes the only token
        st.observe_monitor()
        n = 2000
        t0 = time.perf_counter()
        for i in range(n):
            job = build_job(WORKFLOW, {"prompt": "a cat", "model": "t2v", "size": "64x64"}, None)
            refusal = st.admission.check(job.app, "64x64x9:10", job.timeout_s, job.timeout_given,
                                         ahead=st.tracker.ahead(job.app, time.time_ns()))
            err = st._refuse(refusal)
        per = (time.perf_counter() - t0) / n
        assert err.status == 429 and err.code == "over_capacity"
        assert per < 0.5e-3, f"{per * 1e6:.0f} µs per refusal"
    finally:
        h.close()


def test_cluster_changes_at_runtime():
    h = Harness(max_inflight=4, send_timeout=0.2, send_total_timeout=0.5)
    try:
        entrances = h.cluster.entrance_map["t2v"]
        h.cluster.entrance_map["t2v"] = []
        r = h.create(prompt="x")
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_entrance"

        # An entrance that is listed but not running: 503, and no slot or record is left behind.
        dead = socket.socket()
        dead.bind(("127.0.0.1", 0))
        h.cluster.entrance_map["t2v"] = [f"tcp://127.0.0.1:{dead.getsockname()[1]}"]
        dead.close()
        r = h.create(prompt="x")
        assert r.status_code == 503 and r.json()["error"]["code"] == "entrance_unavailable"
        assert "127.0.0.1" not in r.json()["error"]["message"]  # the instances' addresses are the log's
        assert h.healthz()["inflight"] == 0
        h.cluster.entrance_map["t2v"] = entrances

        # No DB: 503. A DB that joins later is used, and its done events are followed.
        first = h.cluster.db_list
        h.cluster.db_list = []
        r = h.create(prompt="x")
        assert r.status_code == 503 and r.json()["error"]["code"] == "db_unavailable"
        db2 = H.DbThread("db1")
        try:
            h.cluster.db_list = [db2.addresses]
            v = h.create(prompt="x").json()
            assert h.http.get(f"/v1/videos/{v['id']}").json()["status"] == "queued"
            assert h.healthz()["inflight"] == 1
            # let the SUB connection settle: PUB drops events for unconnected peers, and a DB's
            # duplicate result publishes nothing again (50 ms was short beside a busy neighbour)
            time.sleep(0.5)
            db2.result(uid_of(v), b"v")
            wait_for(lambda: h.healthz()["inflight"] == 0, what="done event from the new DB")
        finally:
            h.cluster.db_list = first
            db2.close()
    finally:
        h.close()


# --- the official openai client ------------------------------------------------------------------
def test_openai_client_works_unchanged(h):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{h.url}/v1", api_key="x", max_retries=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the Sora API deprecation notice
        video = client.videos.create(prompt="a whale", model="t2v", size="64x64", seconds="1",
                                     extra_body={"steps": 2, "seed": 11, "guidance": 3})
        assert video.status == "queued" and video.model == "t2v" and video.size == "64x64"
        msg = recv_uid(h, video.id.removeprefix("video_"))
        assert msg.header["params"]["steps"] == 2 and msg.header["params"]["seed"] == 11
        assert msg.header["params"]["num_frames"] == 17
        assert client.videos.retrieve(video.id).status == "queued"

        h.db.progress(msg.uid, 66)
        wait_for(lambda: client.videos.retrieve(video.id).progress == 66, what="progress via openai")
        h.db.result(msg.uid, b"openai-mp4-bytes")
        wait_for(lambda: client.videos.retrieve(video.id).status == "completed", what="completed via openai")
        assert client.videos.download_content(video.id).content == b"openai-mp4-bytes"

        # image-to-video with a file upload
        v2 = client.videos.create(prompt="it moves", model="i2v", input_reference=("ref.png", png(24, 16), "image/png"))
        assert recv_uid(h, v2.id.removeprefix("video_")).parts["image"].shape == (16, 24, 3)

        # an image reference object through extra_body (flattened to input_reference[image_url])
        data_url = "data:image/png;base64," + base64.b64encode(png(32, 48)).decode()
        v3 = client.videos.create(prompt="it moves", model="i2v", extra_body={"input_reference": {"image_url": data_url}})
        assert recv_uid(h, v3.id.removeprefix("video_")).parts["image"].shape == (48, 32, 3)

        with pytest.raises(openai.BadRequestError) as e:
            client.videos.create(prompt="x", model="t2v", size="100x100")
        assert "multiples of 16" in str(e.value)
        with pytest.raises(openai.NotFoundError):
            client.videos.retrieve("video_" + "f" * 32)
        deleted = client.videos.delete(v2.id)
        assert deleted.deleted and deleted.object == "video.deleted"


def test_openai_client_sees_rate_limit():
    openai = pytest.importorskip("openai")
    h = Harness(max_inflight=1)
    try:
        client = openai.OpenAI(base_url=f"{h.url}/v1", api_key="x", max_retries=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            client.videos.create(prompt="a", model="t2v")
            with pytest.raises(openai.RateLimitError) as e:
                client.videos.create(prompt="b", model="t2v")
        assert e.value.response.headers["retry-after"] == "1"
    finally:
        h.close()


# --- the entry point ------------------------------------------------------------------------------
SERVE_SCRIPT = """
from onepiece.config import deploy_dir, load_workflow
from onepiece.proxy.cluster import StaticCluster
from onepiece.proxy.server import serve

cluster = StaticCluster(load_workflow(deploy_dir() / "wan21.yaml"))
serve(cluster, "127.0.0.1", 0, 4, 1 << 20, on_bound=lambda host, port: print("PORT", port, flush=True),
      log_level="warning")
print("STOPPED", flush=True)
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_serve_reports_its_port_and_stops_cleanly_on_signals(sig):
    import signal
    import subprocess

    import httpx

    proc = subprocess.Popen([sys.executable, "-c", SERVE_SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    watchdog = threading.Timer(30, proc.kill)  # bounds the blocking reads below if the proxy hangs
    watchdog.start()
    try:
        line = proc.stdout.readline()
        assert line.startswith("PORT "), (line, proc.stderr.read() if proc.poll() is not None else "")
        port = int(line.split()[1])
        assert port > 0
        r = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
        assert r.status_code == 200 and r.json()["entrances"] == {"t2v": 0, "i2v": 0}
        proc.send_signal(getattr(signal, sig))
        assert proc.wait(10) == 0
        assert "STOPPED" in proc.stdout.read()
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_each_stage_is_told_what_the_stages_after_it_need():
    """The header's reserve: per stage, the standalone time of the stages after it, so a stage
    schedules to finish early enough for the rest of the pipeline to meet the deadline."""
    h = Harness()
    try:
        h.cluster.monitor_view = capacity_view(denoise_s=0.5)
        r = h.create(prompt="x", model="t2v", priority=3, timeout_s=30)
        assert r.status_code == 200, r.text
        msg = h.recv()
        assert msg.header["priority"] == 3
        assert msg.header["reserve"] == {"text_encode": pytest.approx(0.55), "denoise_t2v": pytest.approx(0.05)}
        assert "target" not in msg.header  # no slo_s: the deadline is what the stages order by
        h.cluster.monitor_view = None  # nothing measured: no reserve
        assert h.create(prompt="y", model="t2v", slo_s=2, timeout_s=30).status_code == 200
        hd = h.recv().header
        assert hd["reserve"] == {}
        # The stages schedule for the target; the request fails only at its deadline.
        assert hd["target"] == hd["ts"] + 2 * 10**9 and hd["deadline"] == hd["ts"] + 30 * 10**9
        assert h.create(prompt="z", model="t2v", priority=5000).status_code == 400
        for field in ("priority", "seed"):  # JSON integers beyond 64 bits (orjson reads them as floats)
            r = h.create(prompt="z", model="t2v", **{field: 10**30})
            assert r.status_code == 400 and f"'{field}': integer too large" in r.json()["error"]["message"], r.text
    finally:
        h.close()


def test_readyz_is_ready_only_when_every_application_can_be_served():
    h = Harness(max_inflight=4)
    try:
        r = h.http.get("/readyz")
        assert r.status_code == 200 and r.json()["status"] == "ready", r.text
        # The NM's view of a set with only the t2v stages, and no denoise worker among them.
        h.cluster.monitor_view = capacity_view(denoise_workers=0)
        r = h.http.get("/readyz")
        missing = r.json()["missing"]
        assert r.status_code == 503 and "t2v: no ready worker at stage 'denoise_t2v'" in missing
        assert "i2v: no ready worker at stage 'image_encode'" in missing
        assert not any(m.startswith("t2v") and "denoise" not in m for m in missing)
        # A set laid out for t2v only (the NM says which applications it serves): ready once its
        # t2v stages are, whatever the i2v stages it never had
        h.cluster.monitor_view = {**capacity_view(denoise_workers=0), "serves": ["t2v"]}
        assert h.http.get("/readyz").json()["missing"] == ["t2v: no ready worker at stage 'denoise_t2v'"]
        h.cluster.monitor_view = {**capacity_view(), "serves": ["t2v"]}
        assert h.http.get("/readyz").status_code == 200
        assert [m["id"] for m in h.http.get("/v1/models").json()["data"]] == ["t2v"]
        h.cluster.monitor_view = None
        h.cluster.entrance_map["i2v"] = []
        r = h.http.get("/readyz")
        assert r.status_code == 503 and r.json()["missing"] == ["i2v: no instance of its first stage 'text_encode'"]
        assert h.healthz()["status"] == "ok"  # alive all along
    finally:
        h.close()
