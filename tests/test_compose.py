"""deploy/docker-compose.yaml, checked without a Docker engine (none runs here): every command
is a valid `onepiece` command line, the services are the topology of deploy/local.yaml, every
instance advertises the name its peers resolve, and the image installs what the roles import."""

from __future__ import annotations

import pytest
import yaml

from onepiece.cli import build_parser
from onepiece.config import deploy_dir, load_topology
from onepiece.transport.registry import host_of

COMPOSE = yaml.safe_load((deploy_dir() / "docker-compose.yaml").read_text())
SERVICES = COMPOSE["services"]
TOPO, WORKFLOW, _ = load_topology(deploy_dir() / "local.yaml")
SET = TOPO.sets[0]


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
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(deploy_dir()).parent / "pyproject.toml").read_text())
    folders = set(project["tool"]["setuptools"]["package-dir"].values())
    for folder in {f.split("/")[0] for f in folders}:
        assert f"COPY {folder} {folder}" in dockerfile, f"the image lacks {folder}/"
    assert "pip install" in dockerfile
