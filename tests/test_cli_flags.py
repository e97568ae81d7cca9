"""Every number a command takes is bounded as it is read (onepiece/argtypes.py): a bad count,
duration, rate or port stops the command at once with the flag's name, not after minutes of
work (`bench sched --requests -5` ran its whole calibration, then failed with a traceback), not
as a traceback (`onepiece db --ttl -5`, `onepiece sim --sets 0`) and not silently (`onepiece
sim --hop-ms -5` simulated negative hops)."""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import time

import pytest

from onepiece.argtypes import Bounded, Numbers
from onepiece.cli import build_parser


def _actions(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, action) for every flag of every (sub)command."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _actions(sub, (*path, name))
        else:
            yield path, action


FLAGS = list(_actions(build_parser()))


def test_no_command_takes_an_unbounded_number():
    bare = [f"{' '.join(path)} {'/'.join(a.option_strings)}" for path, a in FLAGS if a.type in (int, float)]
    assert bare == [], bare
    assert sum(isinstance(a.type, Bounded) for _, a in FLAGS) >= 70
    assert sum(isinstance(a.type, Numbers) for _, a in FLAGS) >= 10


def _out_of_range(t: Bounded) -> list[str]:
    bad = [t.low if t.open_low else t.low - 1] if t.low is not None else []
    bad += [t.high + 1] if t.high is not None else []
    return [str(x) for x in bad] + (["nan", "inf", "x"] if t.kind is float else ["1.5", "x"])


@pytest.mark.parametrize("path,action", [(p, a) for p, a in FLAGS if isinstance(a.type, (Bounded, Numbers))],
                         ids=lambda x: " ".join(x) if isinstance(x, tuple) else "/".join(x.option_strings))
def test_every_bounded_flag_refuses_what_is_out_of_its_range(path, action):
    t = action.type
    item = t.item if isinstance(t, Numbers) else t
    bad = _out_of_range(item)
    if isinstance(t, Numbers):  # a list: any bad item, or an empty one, spoils it
        bad = [f"1,{x}" for x in bad] + ["", "1,,2"]
    for value in bad:
        with pytest.raises(argparse.ArgumentTypeError):
            t(value)
    default = t(action.default) if isinstance(action.default, str) else action.default  # argparse parses a str
    if default is not None:  # the default is in range
        values = default if isinstance(t, Numbers) else [default]
        assert all(item(str(v)) == v and math.isfinite(v) for v in values)


@pytest.mark.parametrize("argv,flag", [
    (["bench", "sched", "--requests", "-5"], "--requests"),
    (["db", "--ttl", "-5"], "--ttl"),
    (["proxy", "--port", "70000"], "--port"),
    (["sim", "--trace", "t.json", "--costs", "c.json", "--workflow", "w.yaml", "--instances", "a=1", "--sets", "0"],
     "--sets"),
    (["sim", "--trace", "t.json", "--costs", "c.json", "--workflow", "w.yaml", "--instances", "a=1", "--hop-ms", "-5"],
     "--hop-ms"),
    # a lognormal's median collapses at such a CV: every step cost ~0
    (["sim", "--trace", "t.json", "--costs", "c.json", "--workflow", "w.yaml", "--instances", "a=1", "--step-cv",
      "1e10"], "--step-cv"),
    (["plan", "--workflow", "w.yaml", "--costs", "c.json", "--rate", "-1"], "--rate"),
    (["bench", "sched", "--loads", "0.5,x"], "--loads"),
    (["profile", "--batch", "100000"], "--batch"),
    (["profile", "--shapes", "64x64x10"], "--shapes"),  # frames 4k+1, as a request's
    (["profile", "-o", "."], "-o/--out"),  # a folder, not a file
    # benchmarks: a bad flag is refused before a deployment starts (these started one, then failed)
    (["bench", "cpu", "--out", "/proc/onepiece-bench"], "--out"),  # unwritable: refused before the work
    (["bench", "e2e", "--cases", "64x64x9:10,63x64x9:10"], "--cases"),
    (["bench", "e2e", "--cases", "0x64x9:10"], "--cases"),
    (["bench", "e2e", "--cases", "64x64x9:0"], "--cases"),
    (["bench", "cpu", "--size", "64x64x9:0"], "--size"),
    (["bench", "overload", "--shape", "48x48x8:1"], "--shape"),  # frames 4k+1
    (["bench", "batching", "--calibrate", "2"], "--calibrate"),  # a closed loop needs 3
    (["bench", "overload", "--warmup", "0", "--capacity-source", "closed-loop"], "--warmup"),
    (["bench", "shares", "--threads", "100000"], "--threads"),  # segfaulted
    (["bench", "shares", "--text-length", "100000000"], "--text-length"),
    (["bench", "curve", "--sizes", "99999999999"], "--sizes"),  # MemoryError
    (["bench", "mp4", "--shapes", "100000x100000x1"], "--shapes"),  # 149 GiB
    (["bench", "simspeed", "--requests", "100000000"], "--requests"),
    (["bench", "parallel", "--dops", "64"], "--dops"),
    (["bench", "transport", "--sizes", "1K,,2K"], "--sizes"),
    (["bench", "dop", "--groups", "3"], "--groups"),  # no cost row at DoP 3: a SimInputError traceback
    (["bench", "dop", "--classes", "X=512x512x2:50", "--mix", "1", "--alpha", "2"], "--classes"),  # KeyError
    (["bench", "simval", "--results", "no-such-run"], "--results"),
    (["bench", "sched", "--trace", "no-such-trace.json"], "--trace"),
    (["bench", "sched", "--classes", "S=i2v/64x64x9:2", "--mix", "1", "--alpha", "2"], "--classes"),  # not deployed
])
def test_a_bad_number_stops_the_real_command_at_once(argv, flag, tmp_path):
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "onepiece", *argv], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert f"argument {flag}: " in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert time.monotonic() - t0 < 30  # refused while reading its flags, before any work


def test_building_the_commands_loads_no_model_library():
    """Every `onepiece` command builds the whole parser (every benchmark's flags too): a module
    that loaded torch for it made `onepiece status` or `keys new` take 2 s instead of 0.5 s."""
    out = subprocess.run([sys.executable, "-c", "import sys; from onepiece.cli import build_parser; build_parser(); "
                          "print(sorted(m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules))"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
