"""Stage functions, registered per (function name, application kind).

A stage function is ordinary Python: ``fn(ctx, msg) -> parts`` returns the payload parts to
forward to the next stage (the last stage returns ``{"content": <mp4 bytes>}``). A function
may instead return a :class:`SteppedTask`, which the worker drives one step at a time so that
later schedulers can interleave requests between denoising steps.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable

from onepiece.transport.message import Message, Part

Parts = dict[str, Part]


@dataclass
class StageContext:
    """What a worker hands to a stage function: its loaded components and its device."""

    components: dict[str, Any]
    device: str = "cpu"


class SteppedTask(abc.ABC):
    """A request computed in steps (e.g. denoising); ``progress`` is in [0, 1]."""

    progress: float = 0.0

    @abc.abstractmethod
    def step(self) -> bool:
        """Run one step; True when no step is left."""

    @abc.abstractmethod
    def result(self) -> Parts:
        """The parts to forward once done."""


StageFn = Callable[[StageContext, Message], "Parts | SteppedTask"]

_functions: dict[tuple[str, str], StageFn] = {}


def stage_function(name: str, kind: str) -> Callable[[StageFn], StageFn]:
    def deco(fn: StageFn) -> StageFn:
        _functions[(name, kind)] = fn
        return fn

    return deco


def lookup(name: str, kind: str) -> StageFn:
    _load_builtin()
    try:
        return _functions[(name, kind)]
    except KeyError:
        raise KeyError(f"no stage function {name!r} for application kind {kind!r}") from None


def _load_builtin() -> None:
    from onepiece.stage.wan import functions  # noqa: F401  (registers the Wan2.1 stages)
