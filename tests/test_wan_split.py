"""The split Wan2.1 stages give the same output as the monolithic diffusers pipelines (DESIGN §6)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from onepiece.config import Workflow
from onepiece.stage.loader import is_built, load_components
from onepiece.stage.registry import StageContext, SteppedTask, lookup
from onepiece.stage.wan.functions import decode_frames
from onepiece.stage.wan.tiny import MARKER, build_tiny, ensure_models
from onepiece.transport.message import Message, decode, encode, new_uid
from workflows import t2v_only

SIZE, FRAMES, STEPS, SEED, GUIDANCE = 32, 9, 4, 1234, 5.0
PROMPT, NEGATIVE = "a cat surfing a wave at sunset", "blurry, low quality"

# (function, model, components) per stage, as deploy/wan21.yaml wires them: the shared stages
# (text_encode, vae_decode) load from the t2v directory and also serve i2v.
STAGES = {
    "t2v": [
        ("text_encode", "t2v", ["text_encoder", "tokenizer"]),
        ("denoise", "t2v", ["transformer", "scheduler"]),
    ],
    "i2v": [
        ("text_encode", "t2v", ["text_encoder", "tokenizer"]),
        ("image_encode", "i2v", ["image_encoder", "image_processor"]),
        ("vae_encode", "i2v", ["vae"]),
        ("denoise", "i2v", ["transformer", "scheduler"]),
    ],
}
DECODE = ("vae_decode", "t2v", ["vae"])


def params(**over: object) -> dict:
    p = dict(
        prompt=PROMPT, negative_prompt=NEGATIVE, width=SIZE, height=SIZE, num_frames=FRAMES,
        steps=STEPS, guidance=GUIDANCE, seed=SEED, fps=8, max_sequence_length=32,
    )
    p.update(over)
    return p


def wire(msg: Message) -> Message:
    """What the next stage receives: encoded, copied to plain bytes frames (read-only), decoded."""
    return decode([bytes(f) for f in encode(msg)])


def run(name: str, kind: str, components: dict, msg: Message) -> Message:
    out = lookup(name, kind)(StageContext(components), msg)
    if isinstance(out, SteppedTask):
        while not out.step():
            pass
        assert out.progress == 1.0
        out = out.result()
    return wire(Message(msg.header, out))


@pytest.fixture(scope="module")
def comps(tiny_models: dict[str, Path]):
    cache: dict[tuple, dict] = {}

    def get(model: str, names: list[str]) -> dict:
        key = (model, tuple(names))
        if key not in cache:
            cache[key] = load_components(tiny_models[model], names)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def image() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (48, 40, 3), dtype=np.uint8)


def split_frames(app: str, comps, image: np.ndarray, **over: object) -> tuple[np.ndarray, Message]:
    parts = {"image": image} if app == "i2v" else {}
    msg = wire(Message({"uid": new_uid(), "app": app, "params": params(**over)}, parts))
    for name, model, names in STAGES[app]:
        msg = run(name, app, comps(model, names), msg)
    assert set(msg.parts) == {"latents"}
    return decode_frames(StageContext(comps(DECODE[1], DECODE[2])), msg), msg


def monolithic_frames(app: str, model_dir: Path, image: np.ndarray) -> np.ndarray:
    from diffusers import WanImageToVideoPipeline, WanPipeline
    from PIL import Image

    cls = WanPipeline if app == "t2v" else WanImageToVideoPipeline
    pipe = cls.from_pretrained(model_dir)
    pipe.set_progress_bar_config(disable=True)
    extra = {"image": Image.fromarray(image)} if app == "i2v" else {}
    out = pipe(
        prompt=PROMPT, negative_prompt=NEGATIVE, height=SIZE, width=SIZE, num_frames=FRAMES,
        num_inference_steps=STEPS, guidance_scale=GUIDANCE, max_sequence_length=32, output_type="np",
        generator=torch.Generator().manual_seed(SEED), **extra,
    )
    return np.asarray(out.frames[0])


@pytest.mark.parametrize("app", ["t2v", "i2v"])
def test_split_matches_monolithic(app: str, tiny_models, comps, image) -> None:
    split, _ = split_frames(app, comps, image)
    mono = monolithic_frames(app, tiny_models[app], image)
    assert split.shape == mono.shape == (FRAMES, SIZE, SIZE, 3)
    assert split.dtype == np.float32 and 0.0 <= split.min() and split.max() <= 1.0
    assert float(np.abs(split - mono).max()) <= 1e-5
    assert float(mono.std()) > 0.01  # not a degenerate (constant) video


def test_vae_decode_mp4(comps, image) -> None:
    import imageio.v3 as iio

    _, msg = split_frames("t2v", comps, image, steps=2, num_frames=5)
    out = lookup("vae_decode", "t2v")(StageContext(comps(DECODE[1], DECODE[2])), msg)
    assert set(out) == {"content"} and isinstance(out["content"], bytes)
    assert out["content"][4:8] == b"ftyp"
    video = iio.imread(out["content"], extension=".mp4")
    assert video.shape == (5, SIZE, SIZE, 3)
    assert iio.immeta(out["content"], extension=".mp4")["fps"] == 8
    # The wire carries it as a bytes part.
    assert wire(Message(msg.header, out)).blob("content") == out["content"]


def test_frames_streamed_to_the_encoder_as_they_decode_make_the_same_video(comps, image) -> None:
    """On a GPU vae_decode streams (frame_chunks into stream_mp4); on the CPU it decodes, then
    encodes: both give every frame, in order."""
    from onepiece.stage.wan.functions import encode_mp4, frame_chunks, stream_mp4

    _, msg = split_frames("t2v", comps, image, steps=2, num_frames=9)
    ctx = StageContext(comps(DECODE[1], DECODE[2]))
    assert [len(c) for c in frame_chunks(ctx, msg)] == [1, 4, 4]  # a latent frame at a time
    import imageio.v3 as iio

    chunks = np.concatenate(list(frame_chunks(ctx, msg)))
    assert float(np.abs(chunks - decode_frames(ctx, msg)).max()) <= 1e-5  # the frames decoding it all gives
    source = np.rint(chunks * 255.0)
    for mp4 in (stream_mp4(frame_chunks(ctx, msg), 8), lookup("vae_decode", "t2v")(ctx, msg)["content"]):
        video = iio.imread(mp4, extension=".mp4").astype(float)
        # every frame, in order, as lossy H.264 keeps them (a frame out of place would be far off)
        assert video.shape == (9, SIZE, SIZE, 3)
        assert all(np.abs(video[i] - source[i]).mean() < np.abs(video[i] - source[j]).mean()
                   for i in range(9) for j in range(9) if j != i and np.abs(source[i] - source[j]).mean() > 8)
        assert np.abs(video - source).mean() < 4
    with pytest.raises(ValueError, match="even height and width"):
        encode_mp4(np.zeros((2, 5, 4, 3), np.uint8), 8)
    # a decode that fails, or gives nothing, ends the encoder's thread too (nothing waits on it)
    with pytest.raises(ValueError, match="no frames"):
        stream_mp4(iter(()), 8)

    def failing():
        yield np.zeros((1, 8, 8, 3), np.uint8)
        raise RuntimeError("the VAE failed")

    with pytest.raises(RuntimeError, match="the VAE failed"):
        stream_mp4(failing(), 8)


def test_interleaved_requests_keep_their_own_scheduler_state(comps, image) -> None:
    """Two denoise tasks stepped alternately give what each gives alone (multistep UniPC, as in
    the real Wan2.1 repos, keeps history in the scheduler)."""
    from diffusers import UniPCMultistepScheduler

    unipc = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    ctx = StageContext({**comps("t2v", ["transformer", "scheduler"]), "scheduler": unipc})
    text = comps("t2v", ["text_encoder", "tokenizer"])
    msgs = [
        run("text_encode", "t2v", text, wire(Message({"uid": new_uid(), "params": params(seed=s, steps=3)})))
        for s in (1, 2)
    ]
    fn = lookup("denoise", "t2v")
    alone = []
    for m in msgs:
        task = fn(ctx, m)
        while not task.step():
            pass
        alone.append(task.result()["latents"])
    tasks = [fn(ctx, m) for m in msgs]
    seen = []
    while not all(t.progress == 1.0 for t in tasks):
        for t in tasks:
            if t.progress < 1.0:
                t.step()
                seen.append(t.progress)
    assert seen[:2] == [pytest.approx(1 / 3)] * 2
    for t, a in zip(tasks, alone):
        assert torch.equal(t.result()["latents"], a)
    assert not torch.equal(alone[0], alone[1])


@pytest.mark.parametrize("app", ["t2v", "i2v"])
def test_batched_steps_give_each_request_what_it_gives_alone(app: str, comps, image) -> None:
    """Three requests that differ in seed, prompt, guidance, step count and step index share
    forward passes (one joins two steps late, one leaves early); each decodes to what it
    decodes to alone, within 1e-4."""
    pre = [("text_encode", "t2v", ["text_encoder", "tokenizer"])] + (STAGES["i2v"][1:3] if app == "i2v" else [])
    variants = [dict(seed=11, steps=4), dict(seed=12, steps=6, guidance=3.0, prompt="a dog on a skateboard"),
                dict(seed=13, steps=3, guidance=7.5)]
    msgs = []
    for over in variants:
        msg = wire(Message({"uid": new_uid(), "app": app, "params": params(**over)},
                           {"image": image} if app == "i2v" else {}))
        for name, model, names in pre:
            msg = run(name, app, comps(model, names), msg)
        msgs.append(msg)
    ctx = StageContext(comps(app, ["transformer", "scheduler"]))
    fn = lookup("denoise", app)
    vae = StageContext(comps(DECODE[1], DECODE[2]))

    def frames(msg: Message, latents: torch.Tensor) -> np.ndarray:
        return decode_frames(vae, wire(Message(msg.header, {"latents": latents})))

    alone = [frames(m, run("denoise", app, ctx.components, m).tensor("latents")) for m in msgs]
    tasks = [fn(ctx, m) for m in msgs]
    assert len({t.key for t in tasks}) == 1 and all(t.nbytes > 0 for t in tasks)
    type(tasks[0]).step_batch(tasks[:2])
    type(tasks[0]).step_batch(tasks[:2])
    while live := [t for t in tasks if not t.done]:
        type(tasks[0]).step_batch(live)
    for t, m, a in zip(tasks, msgs, alone):
        diff = float(np.abs(frames(m, t.result()["latents"]) - a).max())
        assert diff <= 1e-4, diff
    assert float(np.abs(alone[0] - alone[1]).max()) > 0.01  # different requests, different videos


def test_keys_keep_incompatible_states_apart(comps, image) -> None:
    ctx = StageContext(comps("t2v", ["transformer", "scheduler"]))
    text = comps("t2v", ["text_encoder", "tokenizer"])

    def task(**over: object):
        m = run("text_encode", "t2v", text, wire(Message({"uid": new_uid(), "params": params(**over)})))
        return lookup("denoise", "t2v")(ctx, m)

    base = task()
    assert task(seed=99, steps=9, guidance=2.0).key == base.key
    for over in (dict(width=48), dict(num_frames=5), dict(guidance=1.0), dict(max_sequence_length=16)):
        assert task(**over).key != base.key, over


def test_a_step_reads_no_module_tree(comps, monkeypatch) -> None:
    """diffusers derives a model's dtype and execution device by walking its modules (0.1 to 1 ms
    a read on the tiny models, reads that made a 64x64x9 request's stages 10% slower than
    WanPipeline's loop): a stage reads each loaded component's once, a denoise step never."""
    from diffusers.models.modeling_utils import ModelMixin

    walks: list[str] = []
    real = torch.nn.Module.named_modules

    def counted(self, *a, **k):  # named_modules is what both reads walk
        if not a and not k:
            walks.append(type(self).__name__)
        return real(self, *a, **k)

    ctx = StageContext(comps("t2v", ["transformer", "scheduler"]))
    text = comps("t2v", ["text_encoder", "tokenizer"])
    vae = StageContext(comps(DECODE[1], DECODE[2]))
    msg = run("text_encode", "t2v", text, wire(Message({"uid": new_uid(), "app": "t2v", "params": params()})))
    run("denoise", "t2v", ctx.components, msg)  # the first request reads each component once
    task = lookup("denoise", "t2v")(ctx, msg)
    monkeypatch.setattr(torch.nn.Module, "named_modules", counted)
    assert isinstance(ctx.components["transformer"], ModelMixin)
    while not task.step():
        pass
    later = lookup("denoise", "t2v")(ctx, msg)  # a later request: nothing read again
    latents = wire(Message(msg.header, task.result()))
    decode_frames(vae, latents)
    decode_frames(vae, latents)
    assert later.key == task.key
    assert walks.count("WanTransformer3DModel") == 0, walks
    assert walks.count("AutoencoderKLWan") <= 1, walks  # the VAE's first read, then none


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_build_is_deterministic_and_ensure_models_builds_only_missing(tiny_models, tmp_path) -> None:
    again = build_tiny("t2v", tmp_path / "t2v-again", seed=0)
    files = _files(again)
    assert any(k.endswith(".safetensors") for k in files)
    assert files == _files(tiny_models["t2v"])
    assert [p.name for p in tmp_path.iterdir()] == ["t2v-again"]  # no temp dir left behind

    wf = Workflow.model_validate(t2v_only({
        "wan-t2v": {"path": str(tiny_models["t2v"]), "tiny": "t2v"},
        "wan-i2v": {"path": "sub/i2v", "tiny": "i2v"},
        "real": {"path": "no/such/dir"},  # no `tiny`: never built
    }, "wan-t2v"))
    built = ensure_models(wf, tmp_path)
    assert built == [tmp_path / "sub" / "i2v"] and is_built(built[0])
    assert _files(built[0]) == _files(tiny_models["i2v"])
    # Shared components are identical across the two kinds.
    for c in ("text_encoder", "tokenizer", "vae"):
        assert _files(tiny_models["t2v"] / c) == _files(built[0] / c)
    assert ensure_models(wf, tmp_path) == []


def test_build_tiny_replaces_only_its_own_builds(tmp_path) -> None:
    path = build_tiny("t2v", tmp_path / "m", seed=0)
    before = _files(path)
    assert build_tiny("t2v", path, seed=7) == path  # a rebuild (`onepiece models build --force`)
    after = _files(path)
    assert after["model_index.json"] == before["model_index.json"]
    assert after["vae/diffusion_pytorch_model.safetensors"] != before["vae/diffusion_pytorch_model.safetensors"]
    assert build_tiny("t2v", path, seed=0, overwrite=False) == path and _files(path) == after
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]

    (path / MARKER).unlink()  # now it looks like real weights: never overwritten
    with pytest.raises(FileExistsError, match="not built by build_tiny"):
        build_tiny("t2v", path, seed=0)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "x").write_text("x")
    with pytest.raises(FileExistsError, match="not a diffusers pipeline"):
        build_tiny("i2v", tmp_path / "junk")


def test_loader_errors(tiny_models, tmp_path) -> None:
    with pytest.raises(ValueError, match="no-such"):
        load_components(tmp_path / "no-such", ["vae"])
    with pytest.raises(ValueError, match=r"image_encoder"):
        load_components(tiny_models["t2v"], ["image_encoder"])
    assert not is_built(tmp_path)


def test_bad_input_raises_clear_error(comps, image) -> None:
    header = {"uid": new_uid(), "params": params()}
    denoise = StageContext(comps("t2v", ["transformer", "scheduler"]))
    with pytest.raises(ValueError, match="missing input part 'prompt_embeds'"):
        lookup("denoise", "t2v")(denoise, wire(Message(header)))
    with pytest.raises(ValueError, match="divisible by 16"):
        lookup("denoise", "t2v")(denoise, wire(Message({**header, "params": params(width=40)})))
    enc = StageContext(comps("i2v", ["image_encoder", "image_processor"]))
    with pytest.raises(ValueError, match="missing input part 'image'"):
        lookup("image_encode", "i2v")(enc, wire(Message(header)))
    with pytest.raises(ValueError, match="uint8 HxWx3"):
        lookup("image_encode", "i2v")(enc, wire(Message(header, {"image": image.astype(np.float32)})))
    with pytest.raises(ValueError, match="more than 16777216"):  # the proxy's pixel bound holds at the stage too
        lookup("image_encode", "i2v")(enc, wire(Message(header, {"image": np.zeros((1, 4096 * 4096 + 1, 3), np.uint8)})))
    with pytest.raises(ValueError, match="missing parameter 'prompt'|'prompt' must be a string"):
        lookup("text_encode", "t2v")(
            StageContext(comps("t2v", ["text_encoder", "tokenizer"])),
            wire(Message({**header, "params": {k: v for k, v in params().items() if k != "prompt"}})),
        )
