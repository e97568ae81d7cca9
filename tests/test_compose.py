"""deploy/docker-compose.yaml, checked without a Docker engine (none runs here): every command
is a valid `onepiece` command line, the services are the topology of deploy/local.yaml, every
instance advertises the name its peers resolve, and the image installs what the roles import."""

from __future__ import annotations

import email
import importlib.metadata
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from onepiece.cli import build_parser
from onepiece.client import Client
from onepiece.config import deploy_dir, load_topology
from onepiece.launcher import free_tcp_address
from onepiece.transport.registry import host_of

from deployment import Up

COMPOSE = yaml.safe_load((deploy_dir() / "docker-compose.yaml").read_text())
SERVICES = COMPOSE["services"]
TOPO, WORKFLOW, _ = load_topology(deploy_dir() / "local.yaml")
SET = TOPO.sets[0]
ROOT = deploy_dir().parent


def args_of(name: str):
    cmd = SERVICES[name]["command"]
    assert cmd[0] == "onepiece", f"{name}: runs {cmd[0]!r}, not onepiece"
    return build_parser().parse_args(cmd[1:])


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_every_command_parses(name):
    args_of(name)  # argparse exits (SystemExit) on a bad flag


def by_role(role: str) -> dict[str, object]:
    return {n: args_of(n) for n in SERVICES if SERVICES[n]["command"][1] == role}


def test_services_are_the_local_topology():
    stages = by_role("stage")
    for stage, count in SET.stages.items():
        assert sum(1 for a in stages.values() if a.stage == stage) == count, stage
    assert len(by_role("db")) == SET.db.count
    assert len(by_role("proxy")) == SET.proxy.count
    assert len(by_role("nm")) == 1 and "models" in SERVICES


def test_every_member_carries_the_nms_deployment_id():
    (nm,) = by_role("nm").values()
    assert nm.deployment
    for role in ("stage", "db", "proxy"):
        for name, a in by_role(role).items():
            assert a.deployment == nm.deployment, name


def test_everyone_finds_the_nm_and_advertises_its_own_name():
    (nm_name, nm), = by_role("nm").items()
    nm_port = nm.address.rsplit(":", 1)[1]
    for role in ("stage", "db", "proxy"):
        for name, a in by_role(role).items():
            assert a.nm == f"tcp://{nm_name}:{nm_port}", name
            assert a.set == SET.name
            bound = a.host if role == "proxy" else host_of(a.listen)
            assert bound == "0.0.0.0" and a.advertise == name, f"{name} must advertise its service name"
            if role == "stage":  # a restarted container returns to where the NM moved it
                assert a.name == name, f"{name} must register under its service name"


def test_a_proxy_on_all_interfaces_gets_its_keys_as_a_private_secret():
    from onepiece.proxy.keys import ENV, beyond_loopback

    for name, a in by_role("proxy").items():
        if not beyond_loopback(a.host):
            continue
        mounts = {m["target"]: m for m in SERVICES[name].get("secrets", [])}
        assert a.api_keys_file, f"{name} binds {a.host} and would refuse to start without keys"
        target = a.api_keys_file.removeprefix("/run/secrets/")
        mount = mounts[target]
        # Copied (not bind-mounted) from the environment, owned by the container's root, 0400:
        # what the proxy's file check (onepiece/secret_file.py) accepts.
        assert COMPOSE["secrets"][mount["source"]] == {"environment": ENV}
        assert mount["uid"] == "0" and int(str(mount["mode"]).replace("0o", ""), 8) & 0o077 == 0


def test_every_role_gets_its_curve_keys_as_private_secrets():
    """Bound to 0.0.0.0, a role turns CURVE on (onepiece/curve_policy.py) and needs its keys in
    the --curve-dir folder, copied from the environment, the secret half 0400: a member the
    members' pair and the set's proxies' public key; the proxy its set's pair and the members'
    public key, and never the members' secret (its key is what a DB lets read users' records)."""
    from onepiece.curve_policy import curve_on
    from onepiece.transport.curve import PUBLIC, SECRET, proxy_pair

    for role in ("nm", "stage", "db", "proxy"):
        for name, a in by_role(role).items():
            addresses = [a.address] if role == "nm" else [*(a.nm.split(",")), *([] if role == "proxy" else [a.listen])]
            assert curve_on(a.auth or "auto", addresses, keys_given=True), name
            assert a.curve_dir == "/run/secrets", f"{name}: no CURVE keys folder"
            mounts = {m["target"]: m for m in SERVICES[name].get("secrets", [])}
            proxies = proxy_pair(a.set if role == "proxy" else SET.name)
            own = f"{proxies}.key_secret" if role == "proxy" else SECRET
            assert {PUBLIC, f"{proxies}.key", own} <= set(mounts), f"{name} lacks its CURVE keys"
            assert (SECRET in mounts) == (role != "proxy") and (f"{proxies}.key_secret" in mounts) == (role == "proxy")
            env = "ONEPIECE_CURVE_PROXY_SECRET" if role == "proxy" else "ONEPIECE_CURVE_SECRET"
            assert COMPOSE["secrets"][mounts[own]["source"]] == {"environment": env}
            assert mounts[own]["uid"] == "0" and int(str(mounts[own]["mode"]).replace("0o", ""), 8) & 0o077 == 0, name


def test_dependencies_exist_and_stages_wait_for_models():
    for name, svc in SERVICES.items():
        deps = svc.get("depends_on") or []
        for dep in deps:
            assert dep in SERVICES, f"{name} depends on unknown {dep}"
    for name in by_role("stage"):
        assert SERVICES[name]["depends_on"]["models"]["condition"] == "service_completed_successfully"
    (proxy_name, proxy), = by_role("proxy").items()
    assert f"{proxy.port}:{proxy.port}" in SERVICES[proxy_name]["ports"]


def test_image_copies_every_package_folder():
    dockerfile = (deploy_dir() / "Dockerfile").read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = set(project["tool"]["setuptools"]["package-dir"].values())
    copied = {src for src, _ in copies(dockerfile)}
    for folder in {f.split("/")[0] for f in folders}:
        assert folder in copied, f"the image lacks {folder}/"
    # the build backend's inputs: the compiled ring module is declared in setup.py
    assert {"pyproject.toml", "setup.py"} <= copied


def copies(dockerfile: str) -> list[tuple[str, str]]:
    """(source, destination) of every COPY from the build context (not from another stage)."""
    out = []
    for line in dockerfile.splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not any(w.startswith("--from") for w in words):
            *sources, dest = words[1:]
            out += [(src, dest.rstrip("/") + "/" + src if dest.endswith("/") else dest) for src in sources]
    return out


@pytest.mark.slow
def test_the_image_steps_give_a_package_that_serves(tmp_path, tiny_models, make_topology):
    """What deploy/Dockerfile does, done without a container engine: a build context of exactly
    the files its COPY lines take, a wheel built from it (the ring's C module compiled), that
    wheel installed in a new venv, and a deployment started from that venv serves a video.
    The venv holds what the wheel declares and nothing else: the distributions its
    Requires-Dist names, and theirs, linked from the test venv (a fresh install of torch and the
    rest takes a minute), so an import the wheel does not declare fails here as in the image;
    never the editable onepiece: the wheel is what runs."""
    context = tmp_path / "context"
    for src, dest in copies((deploy_dir() / "Dockerfile").read_text()):
        target = context / dest
        if (ROOT / src).is_dir():
            # .dockerignore's patterns: sources only, nothing an editable install compiled here
            shutil.copytree(ROOT / src, target, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info"))
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / src, target)
    wheels = tmp_path / "wheels"
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels),
         str(context)])
    (wheel,) = wheels.glob("onepiece-*.whl")
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = str(venv / "bin" / "python")
    run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", str(wheel)])
    # Run from outside the checkout: from its root, `import onepiece` would find the source folder.
    site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=tmp_path).strip())
    with zipfile.ZipFile(wheel) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        declared = email.message_from_bytes(z.read(meta)).get_all("Requires-Dist")
    for name in dependency_closure(declared):
        dist = importlib.metadata.distribution(name)
        for top in {f.parts[0] for f in dist.files or [] if f.parts[0] != ".."}:
            source = Path(dist.locate_file(top))
            if source.exists() and not (site / top).exists():
                (site / top).symlink_to(source)
    where = run([python, "-c", "import onepiece, onepiece.transport.ring._atomics as a; print(onepiece.__file__)"],
                cwd=tmp_path)
    assert where.startswith(str(venv)), where

    nm = free_tcp_address()
    (tmp_path / "deployment").mkdir()
    topology = make_topology(tmp_path / "deployment", tiny_models, nm, dbs=1,
                             stages={"text_encode": 1, "denoise_t2v": 1, "vae_decode": 1})
    dep = Up(topology, tmp_path / "logs", nm, python=python, cwd=tmp_path)
    try:
        url = dep.wait_for(r"serves the API at (http://\S+)", timeout=240).group(1)
        with Client(url) as c:
            video = c.submit("from the wheel", model="t2v", size="32x32", num_frames=5, steps=2)
            assert c.wait(video["id"], timeout=120)["status"] == "completed"
    finally:
        dep.stop()


def dependency_closure(requires: list[str]) -> set[str]:
    """The distributions ``requires`` (Requires-Dist lines, no extras asked) names, and theirs,
    as installed in this venv."""
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(Requirement(r), frozenset()) for r in requires]
    while todo:
        req, extras = todo.pop()  # extras: those its dependent asked of the distribution it came from
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in (*extras, "")):
            continue
        key = (canonicalize_name(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        todo += [(Requirement(r), key[1]) for r in importlib.metadata.distribution(key[0]).requires or []]
    return {name for name, _ in seen}


def run(cmd: list[str], cwd: Path | None = None) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=cwd)
    assert out.returncode == 0, f"{' '.join(cmd)}:\n{out.stdout}\n{out.stderr}"
    return out.stdout
