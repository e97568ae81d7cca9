"""Checked values for command-line flags (argparse types): bounded numbers, and devices.

Every count, duration, rate and port a command takes is checked as argparse reads it, so a bad
value stops the command at once with the flag's name: not minutes later (`bench sched
--requests -5` ran its whole calibration first), not as a traceback (`onepiece db --ttl -5`),
and not silently (`sim --hop-ms -5` simulated negative hops).
"""

from __future__ import annotations

import argparse
import math
import re


class Bounded:
    """A finite ``kind`` (int or float) in [low, high]; with ``open_low``, above ``low``."""

    def __init__(self, kind: type, low: float | None = None, high: float | None = None, open_low: bool = False,
                 unit: str = "") -> None:
        self.kind, self.low, self.high, self.open_low, self.unit = kind, low, high, open_low, unit
        self.__name__ = kind.__name__  # argparse names a type by it

    def describe(self) -> str:
        """What a value must be, e.g. "an integer >= 1", "between 1 and 600 seconds"."""
        what = "an integer" if self.kind is int else "a number"
        if self.low is not None and self.high is not None and not self.open_low:
            return f"{'an integer ' if self.kind is int else ''}between {self.low:g} and {self.high:g}{self.unit}"
        bounds = [f"{'>' if self.open_low else '>='} {self.low:g}"] if self.low is not None else []
        bounds += [f"<= {self.high:g}"] if self.high is not None else []
        return f"{what} {' and '.join(bounds)}{self.unit}" if bounds else what

    def __call__(self, value: str) -> int | float:
        try:
            x = self.kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {'an integer' if self.kind is int else 'a number'}: {value!r} "
                                             f"(must be {self.describe()})") from None
        low_ok = self.low is None or (x > self.low if self.open_low else x >= self.low)
        if not (math.isfinite(x) and low_ok and (self.high is None or x <= self.high)):
            raise argparse.ArgumentTypeError(f"must be {self.describe()} (got {value})")
        return x


def count(low: int = 1, high: int | None = None) -> Bounded:
    """An integer of at least ``low`` (and at most ``high``)."""
    return Bounded(int, low, high)


def between(low: float, high: float, unit: str = "") -> Bounded:
    """A number in [low, high]."""
    return Bounded(float, low, high, unit=unit)


def positive(unit: str = "") -> Bounded:
    """A number above 0 (a duration, a rate, a factor)."""
    return Bounded(float, 0.0, open_low=True, unit=unit)


def non_negative(unit: str = "") -> Bounded:
    """A number of at least 0 (where 0 means none)."""
    return Bounded(float, 0.0, unit=unit)


class Numbers:
    """Comma-separated numbers, each one ``item`` (a Bounded), e.g. ``0.5,0.8,1``: a list."""

    def __init__(self, item: Bounded) -> None:
        self.item = item
        self.__name__ = "list"

    def __call__(self, value: str) -> list[int | float]:
        items = [x.strip() for x in value.split(",")]
        if not all(items):
            raise argparse.ArgumentTypeError(f"expected comma-separated values, each {self.item.describe()} "
                                             f"(got {value!r})")
        out = []
        for x in items:
            try:
                out.append(self.item(x))
            except argparse.ArgumentTypeError as e:
                raise argparse.ArgumentTypeError(f"{x!r} in {value!r}: {e}") from None
        return out


def numbers(item: Bounded) -> Numbers:
    """Comma-separated values, each an ``item``."""
    return Numbers(item)


def out_dir(value: str) -> str:
    """A folder a command writes its results to: made now and written to once, so that a path
    that cannot be written stops the command before its work, not after it."""
    import os
    import tempfile

    try:
        os.makedirs(value, exist_ok=True)
        with tempfile.TemporaryFile(dir=value):
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write to folder {value!r}: {e.strerror or e}") from None
    return value


def out_file(value: str) -> str:
    """A file a command writes: its folder as ``out_dir``, and not a folder itself."""
    import os

    if os.path.isdir(value):
        raise argparse.ArgumentTypeError(f"{value!r} is a folder; name the file to write")
    out_dir(os.path.dirname(value) or ".")
    return value


# The largest video a shipped workflow serves (deploy/wan21-real.yaml's limits): a shape a command
# times or encodes stays within it (`bench mp4 --shapes 100000x100000x1` asked for 149 GiB of frames).
MAX_VIDEO = (1280, 1280, 81)


class VideoShapes:
    """An argparse type: comma-separated ``WxHxFRAMES`` -> [(w, h, frames)], width and height
    multiples of ``multiple`` and frames 4k+1 where ``requests`` (as a request's: what a cost
    row prices), all within ``MAX_VIDEO``."""

    def __init__(self, multiple: int = 16, requests: bool = True) -> None:
        self.multiple, self.requests = multiple, requests
        self.__name__ = "list"

    def __call__(self, value: str) -> list[tuple[int, int, int]]:
        mw, mh, mf = MAX_VIDEO
        out = []
        for item in value.split(","):
            try:
                w, h, f = (int(x) for x in item.lower().split("x"))
            except ValueError:
                raise argparse.ArgumentTypeError(f"bad shape {item!r}: expected WxHxFRAMES, e.g. 64x64x9") from None
            if not (0 < w <= mw and 0 < h <= mh) or w % self.multiple or h % self.multiple:
                raise argparse.ArgumentTypeError(f"bad shape {item!r}: width and height must be multiples of "
                                                 f"{self.multiple} up to {mw}x{mh}")
            if not 1 <= f <= mf or (self.requests and (f - 1) % 4):
                raise argparse.ArgumentTypeError(f"bad shape {item!r}: frames must be "
                                                 f"{'4k+1 (1, 5, 9, ...) ' if self.requests else ''}from 1 to {mf}")
            out.append((w, h, f))
        return out


SHARE = Bounded(float, 0.0, 1.0, open_low=True)  # a share of something: above 0, at most 1
PORT = count(0, 65535)  # 0: any free one
SEED = count(0)


DEVICE = r"cpu|cuda(:\d+)?"  # what a stage's workers run on (one CUDA device each where several)


def torch_device(value: str) -> str:
    """A torch device as a stage's ``device`` takes it: cpu, cuda or cuda:N."""
    if not re.fullmatch(DEVICE, value):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {value!r}")
    return value
