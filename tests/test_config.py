"""Workflow and topology YAML: the shipped files load, and bad files name file, key and expectation."""

import subprocess
import sys

import pytest

from onepiece.config import ConfigError, deploy_dir, load_topology, load_workflow


def test_shipped_files_load_and_share_stages():
    topo, wf, base = load_topology(deploy_dir() / "local.yaml")
    assert base == deploy_dir()
    t2v, i2v = wf.applications["t2v"].stages, wf.applications["i2v"].stages
    assert {"text_encode", "vae_decode"} <= set(t2v) & set(i2v)  # shared stages
    assert wf.next_stage("i2v", "text_encode") == "image_encode" and wf.next_stage("t2v", "vae_decode") is None
    assert set(topo.sets[0].stages) == set(wf.stages)


def test_shipped_ha_topology_runs_three_node_managers_on_zookeeper(tmp_path):
    from onepiece.launcher import Deployment

    topo, _, _ = load_topology(deploy_dir() / "ha.yaml")
    local, _, _ = load_topology(deploy_dir() / "local.yaml")
    assert topo.nm.zk == "127.0.0.1:2181" and topo.nm.addresses() == [
        "tcp://127.0.0.1:7700", "tcp://127.0.0.1:7701", "tcp://127.0.0.1:7702"]
    assert topo.sets == local.sets
    dep = Deployment(deploy_dir() / "ha.yaml", log_dir=tmp_path)
    try:
        nms = [c for c in dep.plan() if c.name.startswith("nm")]
    finally:
        dep.stop()
    assert len(nms) == 3 and all("--zk" in c.argv for c in nms)


def write(tmp_path, text, name="wf.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


GOOD = (deploy_dir() / "wan21.yaml").read_text()
SCHED = "schedule: {policy: slo, max_batch: 4}"  # the shipped denoise stages' line


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda t: t.replace("    components: [vae]\n  denoise_t2v", "    components: [vae]\n    workers: -1\n  denoise_t2v", 1),
         "stages.vae_encode.workers: Input should be greater than 0 (got -1)"),
        (lambda t: t.replace("    components: [vae]\n  denoise_t2v", "    components: [vae]\n    device: gpu\n  denoise_t2v", 1),
         "stages.vae_encode.device: String should match pattern '^(cpu|cuda(:\\d+)?)$' (got 'gpu')"),
        (lambda t: t.replace("model: wan-i2v\n    components: [image_encoder", "model: nope\n    components: [image_encoder"),
         "stages.image_encode.model: unknown model 'nope'"),
        (lambda t: t.replace("stages: [text_encode, denoise_t2v, vae_decode]", "stages: [text_encode, denoise, vae_decode]"),
         "applications.t2v.stages[1]: unknown stage 'denoise'"),
        (lambda t: t.replace("    tiny: t2v\n", "    tiny: t2v\n    colour: blue\n", 1),
         "models.wan-t2v.colour: Extra inputs are not permitted"),
        (lambda t: t.replace("fps: 16}", "fps: fast}", 1), "applications.t2v.defaults.fps"),
        (lambda t: t + "\n  broken: [\n", "not valid YAML"),
        # step scheduling options name their key
        (lambda t: t.replace(SCHED, "schedule: {policy: lifo}", 1), "stages.denoise_t2v.schedule.policy: Input should be"),
        (lambda t: t.replace(SCHED, "schedule: {policy: slo, max_batch: 0}", 1),
         "stages.denoise_t2v.schedule.max_batch: Input should be greater than or equal to 1 (got 0)"),
        (lambda t: t.replace(SCHED, "schedule: {policy: fcfs, max_batch: 4}", 1),
         "stages.denoise_t2v.schedule: max_batch: fcfs runs every request alone"),
        (lambda t: t.replace(SCHED, "schedule: {chunk_stepz: 2}", 1),
         "stages.denoise_t2v.schedule.chunk_stepz: Extra inputs are not permitted"),
        (lambda t: t.replace(SCHED, "schedule: {costs: no-such-table.json}", 1), "stages.denoise_t2v.schedule.costs:"),
        (lambda t: "just a string\n", "(top level)"),
        # what only showed at run time (workers crash-looping while `up` waited out its timeout)
        (lambda t: t.replace("function: denoise\n    model: wan-t2v", "function: frobnicate\n    model: wan-t2v", 1),
         "stages.denoise_t2v.function: unknown stage function 'frobnicate'"),
        (lambda t: t.replace("components: [transformer, scheduler]", "components: [transformer, flux]", 1),
         "stages.denoise_t2v.components: function 'denoise' needs ['scheduler', 'transformer'], lacks ['scheduler']"),
        (lambda t: t.replace("stages: [text_encode, denoise_t2v, vae_decode]",
                             "stages: [text_encode, denoise_t2v, text_encode, vae_decode]"),
         "applications.t2v.stages: a stage is listed twice"),
        (lambda t: t.replace("stages: [text_encode, denoise_t2v, vae_decode]", "stages: [denoise_t2v, text_encode, vae_decode]"),
         "applications.t2v.stages: a t2v application runs text_encode (any order), then denoise, then vae_decode"),
        (lambda t: t.replace("stages: [text_encode, denoise_t2v, vae_decode]", "stages: [text_encode, denoise_t2v, vae_encode]"),
         "stage 'vae_encode' runs 'vae_encode', which serves ['i2v'], not t2v"),
        (lambda t: t.replace("defaults: {width: 64,", "defaults: {width: 1024,", 1),
         "applications.t2v: defaults.width: 1024 is what a request without it would ask for"),
        (lambda t: t.replace("defaults: {width: 64,", "defaults: {width: 60,", 1), "must be a multiple of 16"),
        (lambda t: t.replace("  vae_decode:\n    model: wan-t2v\n", "  vae_decode:\n    model: wan-t2v\n    model: wan-i2v\n", 1),
         "key 'model' is given twice"),
        # `onepiece move X idle` means the idle pool: a stage so named could never be moved to
        (lambda t: t.replace("  vae_decode:\n    model: wan-t2v\n", "  idle:\n    function: vae_decode\n"
                             "    model: wan-t2v\n", 1), "stages.idle: the name is taken by the idle pool"),
    ],
)
def test_bad_workflow_names_file_key_and_expectation(tmp_path, mutate, expected):
    path = write(tmp_path, mutate(GOOD))
    with pytest.raises(ConfigError) as e:
        load_workflow(path)
    assert str(path) in str(e.value)
    assert expected in str(e.value)


def test_bad_topology_names_the_key(tmp_path):
    write(tmp_path, GOOD)
    path = write(tmp_path, "workflow: wf.yaml\nsets:\n  - name: a\n    stages: {denoise_t2v: 1, warp_drive: 2}\n", "topo.yaml")
    with pytest.raises(ConfigError, match=r"topo.yaml: sets.a.stages.warp_drive: unknown stage"):
        load_topology(path)
    path = write(tmp_path, "workflow: wf.yaml\nsets:\n  - stages: {denoise_t2v: -3}\n", "topo2.yaml")
    with pytest.raises(ConfigError, match=r"topo2.yaml: sets.0.stages: .*denoise_t2v: expected an instance count"):
        load_topology(path)
    with pytest.raises(ConfigError, match="missing.yaml: cannot read"):
        load_topology(tmp_path / "missing.yaml")


def test_cli_reports_config_errors_and_bad_flags(tmp_path):
    path = write(tmp_path, "workflow: nowhere.yaml\nsets: []\n", "topo.yaml")
    out = subprocess.run([sys.executable, "-m", "onepiece", "nm", "--topology", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "sets: List should have at least 1 item" in out.stderr
    out = subprocess.run([sys.executable, "-m", "onepiece", "up", "--ready-timeout", "soon"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "argument --ready-timeout: not a number: 'soon'" in out.stderr
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    out = subprocess.run([sys.executable, "-m", "onepiece", "up", "--logs", str(blocked / "logs")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "cannot be made" in out.stderr and "Traceback" not in out.stderr, out.stderr


@pytest.mark.parametrize(
    "sets, expected",
    [
        ("  - {name: a, stages: {vae_decode: 1}}\n  - {name: a, stages: {vae_decode: 1}}\n", r"sets\.1\.name: set name 'a' is already used by sets\.0"),
        ("  - {name: a, proxy: {port: 8000, count: 2}, stages: {vae_decode: 1}}\n  - {name: b, proxy: {port: 8001}, stages: {vae_decode: 1}}\n",
         r"sets\.b\.proxy\.port: proxy port 8001 \(ports 8001-8001\) is also taken by set 'a'"),
        ("  - {name: a, stages: {vae_decode: 1}}\n  - {name: b, stages: {vae_decode: 1}}\n",  # both on the default port 8000
         r"sets\.b\.proxy\.port: proxy port 8000"),
        ("  - {name: a, proxy: {port: 65535, count: 2}, stages: {vae_decode: 1}}\n", r"sets\.a\.proxy\.port: 2 proxies from port 65535"),
        ("  - {name: a, proxy: {port: 7699, count: 2}, stages: {vae_decode: 1}}\n",  # the default nm.address: tcp://127.0.0.1:7700
         r"sets\.a\.proxy\.port: proxy port 7700 \(ports 7699-7700\) is the node manager's \(tcp://127\.0\.0\.1:7700\)"),
        ("  - {name: 'a/b', stages: {vae_decode: 1}}\n", r"sets\.0\.name: String should match pattern"),
        ("  - {name: a, db: {replication: 0}, stages: {vae_decode: 1}}\n", r"sets\.0\.db\.replication: Input should be greater than 0"),
        ("  - {name: a, stages: {vae_decode: 0}}\n", r"sets\.0: set 'a' starts no instance"),
    ],
)
def test_bad_sets_name_the_key(tmp_path, sets, expected):
    write(tmp_path, GOOD)
    path = write(tmp_path, "workflow: wf.yaml\nsets:\n" + sets, "topo.yaml")
    with pytest.raises(ConfigError, match=f"topo.yaml: {expected}"):
        load_topology(path)


def test_several_sets_with_ports_apart_or_any_free_port_load(tmp_path):
    write(tmp_path, GOOD)
    path = write(tmp_path, "workflow: wf.yaml\nsets:\n"
                 "  - {name: a, proxy: {port: 8000, count: 2}, db: {count: 1, replication: 3}, stages: {vae_decode: 1}}\n"
                 "  - {name: b, proxy: {port: 8002}, stages: {vae_decode: 1}}\n"
                 "  - {name: c, proxy: {port: 0, count: 3}, stages: {vae_decode: 1}}\n"
                 "  - {name: d, proxy: {port: 0}, stages: {vae_decode: 1}}\n", "topo.yaml")
    topo, _, _ = load_topology(path)
    assert [s.name for s in topo.sets] == ["a", "b", "c", "d"]
    assert topo.sets[0].db.replication == 3 and topo.sets[1].db.replication == 2  # capped at count when run


def test_write_topology_declares_several_sets_and_the_launcher_runs_them(tmp_path):
    from onepiece.launcher import Deployment, write_topology

    models = {"t2v": tmp_path / "t2v", "i2v": tmp_path / "i2v"}
    one = write_topology(tmp_path, models, "tcp://127.0.0.1:7799", dbs=1, stages={"text_encode": 1})
    topo, _, _ = load_topology(one)
    assert [s.name for s in topo.sets] == ["set0"] and topo.sets[0].proxy.port == 0
    # proxy and db options go over the defaults key by key: a test's deployment never takes port
    # 8000 (a user's own `onepiece up`, or another test's; two tests once collided there)
    topo, _, _ = load_topology(write_topology(tmp_path, models, "tcp://127.0.0.1:7799", dbs=1,
                                              proxy={"monitor": False}, db={"ttl_s": 5.0}))
    (s,) = topo.sets
    assert (s.proxy.port, s.proxy.count, s.proxy.monitor, s.db.count, s.db.ttl_s) == (0, 1, False, 1, 5.0)
    path = write_topology(tmp_path, models, "tcp://127.0.0.1:7799", stages={"text_encode": 1}, sets=[
        {"name": "a", "proxy": {"max_inflight": 1}, "db": {"count": 1}},
        {"db": {"count": 3, "replication": 2}, "stages": {"vae_decode": 2}},
    ])
    topo, _, _ = load_topology(path)
    a, b = topo.sets
    assert (a.name, a.proxy.port, a.proxy.max_inflight, a.db.count, a.stages) == ("a", 0, 1, 1, {"text_encode": 1})
    assert (b.name, b.db.count, b.db.replication, b.stages) == ("set1", 3, 2, {"vae_decode": 2})
    dep = Deployment(path, tmp_path / "logs")
    try:
        argv = {c.name: c.argv for c in dep.plan()}
    finally:
        dep.stop()
    assert sorted(argv) == ["a-db0", "a-proxy0", "a-text_encode0", "nm", "set1-db0", "set1-db1", "set1-db2",
                            "set1-proxy0", "set1-vae_decode0", "set1-vae_decode1"]
    db = argv["a-db0"]
    assert db[db.index("--replication") + 1] == "1"  # 2 asked, capped at the set's one DB
    db = argv["set1-db2"]
    assert db[db.index("--replication") + 1] == "2" and db[db.index("--set") + 1] == "set1"


def test_db_command_takes_a_replication_factor(capsys):
    from onepiece.cli import build_parser

    assert build_parser().parse_args(["db"]).replication == 2
    assert build_parser().parse_args(["db", "--replication", "3"]).replication == 3
    with pytest.raises(SystemExit):
        build_parser().parse_args(["db", "--replication", "0"])
    assert "must be an integer >= 1" in capsys.readouterr().err


GOOD_PARAMS = {"prompt": "a cat", "negative_prompt": "", "width": 64, "height": 64, "num_frames": 9, "steps": 10,
               "guidance": 5.0, "seed": 1, "fps": 16, "max_sequence_length": 64}


@pytest.mark.parametrize("change, expected", [
    ({"steps": 1_000_000}, "params.steps: 1000000 exceeds the application's limit of 100"),
    ({"width": 4096}, "params.width: 4096 exceeds"),
    ({"num_frames": 8}, "params.num_frames: must be 4k+1"),
    ({"prompt": "x" * 5000}, "params.prompt: 5000 exceeds"),
    ({"steps": "10"}, "params.steps: Input should be a valid integer"),
    ({"guidance": float("nan")}, "params.guidance"),
    ({"seed": -1}, "params.seed"),
    ({"width": 40}, "params.width: Input should be a multiple of 16"),
    ({"extra": 1}, "params.extra: Extra inputs are not permitted"),
    ({"prompt": None}, "params.prompt"),
])
def test_every_stage_holds_a_request_to_its_applications_limits(change, expected):
    app = load_workflow(deploy_dir() / "wan21.yaml").applications["t2v"]
    assert app.check_params(GOOD_PARAMS).steps == 10
    with pytest.raises(ValueError) as e:
        app.check_params({**GOOD_PARAMS, **change})
    assert expected in str(e.value)
    with pytest.raises(ValueError, match="params: Input should be a valid dictionary"):
        app.check_params([1])


def test_a_set_serves_the_applications_it_is_laid_out_for():
    from onepiece.config import SetSpec

    wf = load_workflow(deploy_dir() / "wan21.yaml")
    t2v = {"text_encode": 1, "denoise_t2v": 1, "vae_decode": 1}
    assert SetSpec(stages=t2v).serves(wf) == ["t2v"]
    assert SetSpec(stages={**t2v, "denoise_t2v": 0}, min={"denoise_t2v": 1}).serves(wf) == ["t2v"]  # kept by a minimum
    assert sorted(SetSpec(stages={s: 1 for s in wf.stages}).serves(wf)) == sorted(wf.applications)
    assert sorted(SetSpec(stages={}, idle=3).serves(wf)) == sorted(wf.applications)  # the NM lays it out


def test_the_node_manager_needs_a_fixed_port(tmp_path):
    write(tmp_path, GOOD)
    path = write(tmp_path, "workflow: wf.yaml\nnm: {address: 'tcp://127.0.0.1:0'}\nsets:\n  - {stages: {vae_decode: 1}}\n",
                 "topo.yaml")
    with pytest.raises(ConfigError, match="nm.address: .*needs a fixed port"):
        load_topology(path)


def test_the_functions_the_config_knows_are_the_registrys():
    """What a workflow may name (onepiece/config.py FUNCTIONS, known without importing torch) is
    what stage/registry.py runs, for the same application kinds."""
    from onepiece.config import FUNCTIONS
    from onepiece.stage import registry

    registry.lookup("denoise", "t2v")  # (loads the built-in functions)
    assert {(name, kind) for name, (kinds, _) in FUNCTIONS.items() for kind in kinds} == set(registry._functions)


@pytest.mark.parametrize("stage,rows,expected", [
    # written for a stage of another name: the stage started from nothing, without a word
    ("denoise_t2v", {"denoise": [{"key": "64x64x9/cfg/L64", "batch": 1, "seconds": 0.01}]},
     "costs.json: no rows for stage 'denoise_t2v' (stages: denoise)"),
    # call keys for a stage that steps (and the reverse): no request's key ever matched them
    ("denoise_t2v", {"denoise_t2v": [{"key": "64x64x9", "batch": 1, "seconds": 0.01}]},
     "stages.denoise_t2v: the workflow's stage steps, so its rows need step keys, not call keys such as '64x64x9'"),
    ("vae_decode", {"vae_decode": [{"key": "64x64x9/cfg/L64", "batch": 1, "seconds": 0.01}]},
     "stages.vae_decode: the workflow's stage is called once, so its rows need call keys, not step keys such as "
     "'64x64x9/cfg/L64'"),
])
def test_a_stage_table_that_cannot_price_the_stage_is_refused(tmp_path, stage, rows, expected):
    import json

    import yaml

    from onepiece.sched.costs import make_table

    (tmp_path / "costs.json").write_text(json.dumps(make_table(rows)))
    wf = yaml.safe_load((deploy_dir() / "wan21.yaml").read_text())
    wf["stages"][stage]["schedule"] = {"costs": "costs.json"}
    path = write(tmp_path, yaml.safe_dump(wf))
    with pytest.raises(ConfigError) as e:
        load_workflow(path)
    assert f"stages.{stage}.schedule.costs: " in str(e.value) and expected in str(e.value)
    rows[stage] = [{"key": "64x64x9/cfg/L64" if stage == "denoise_t2v" else "64x64x9", "batch": 1, "seconds": 0.01}]
    (tmp_path / "costs.json").write_text(json.dumps(make_table(rows)))
    assert load_workflow(path).cost_table(stage, tmp_path) == {rows[stage][0]["key"]: {1: 0.01}}
