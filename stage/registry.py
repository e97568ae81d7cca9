"""Stage functions, registered per (function name, application kind).

A stage function is ordinary Python: ``fn(ctx, msg) -> parts`` returns the payload parts to
forward to the next stage (the last stage returns ``{"content": <mp4 bytes>}``): a one-step
task. A function may instead return a :class:`SteppedTask` (it prepared the request's state),
which the worker advances step by step, batched with compatible states, as the stage's
scheduler decides, and finishes once its last step is done.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, Hashable

from onepiece.transport.message import Message, Part

Parts = dict[str, Part]


@dataclass
class StageContext:
    """What a worker hands to a stage function: its loaded components and its device."""

    components: dict[str, Any]
    device: str = "cpu"


class SteppedTask(abc.ABC):
    """The step contract (DESIGN §6.1): a request's state, prepared once by the stage function,
    advanced a step at a time, alone or in a batch of compatible states, and finished once.

    ``progress`` is in [0, 1]. ``key`` says what the tensors require: states with equal keys
    (and of one class) may be advanced together by ``step_batch``, in one forward pass, whatever
    their step counts and indices. ``nbytes`` is what the state keeps resident on its device.
    """

    progress: float = 0.0

    @property
    def key(self) -> Hashable:
        return id(self)  # compatible with nothing else, unless a task says otherwise

    @property
    def nbytes(self) -> int:
        return 0

    @property
    @abc.abstractmethod
    def done(self) -> bool:
        """No step is left."""

    @classmethod
    def step_batch(cls, tasks: "list[SteppedTask]") -> None:
        """Advance each of ``tasks`` (equal keys, none done) by one step; this default runs
        them one after another, a batching task does it in one forward pass."""
        for t in tasks:
            t.step()

    def step(self) -> bool:
        """Run one step alone; True when no step is left."""
        if not self.done:
            type(self).step_batch([self])
        return self.done

    @abc.abstractmethod
    def result(self) -> Parts:
        """The parts to forward once done."""


StageFn = Callable[[StageContext, Message], "Parts | SteppedTask"]

_functions: dict[tuple[str, str], StageFn] = {}
_stepped: set[tuple[str, str]] = set()
_parallel: dict[tuple[str, str], Callable[[Any], Any]] = {}


def stage_function(name: str, kind: str, stepped: bool = False,
                   parallel: Callable[[Any], Any] | None = None) -> Callable[[StageFn], StageFn]:
    """Register ``fn`` as stage function ``name`` for application kind ``kind``; ``stepped``:
    it returns a SteppedTask (its scheduler then counts steps and batches it); ``parallel``:
    how a collaboration group steps its tasks together (``parallel(collective)`` gives an
    object whose ``step([(ranks, tasks), ...])`` runs one step of each batch on its ranks)."""
    def deco(fn: StageFn) -> StageFn:
        _functions[(name, kind)] = fn
        if stepped:
            _stepped.add((name, kind))
        if parallel is not None:
            _parallel[(name, kind)] = parallel
        return fn

    return deco


def parallel_of(name: str, kind: str) -> Callable[[Any], Any]:
    """How a collaboration group steps function ``name`` for ``kind`` (KeyError if it cannot)."""
    lookup(name, kind)
    try:
        return _parallel[(name, kind)]
    except KeyError:
        raise KeyError(f"stage function {name!r} for {kind!r} cannot run in a collaboration group") from None


def is_stepped(name: str, kind: str) -> bool:
    lookup(name, kind)
    return (name, kind) in _stepped


def lookup(name: str, kind: str) -> StageFn:
    _load_builtin()
    try:
        return _functions[(name, kind)]
    except KeyError:
        raise KeyError(f"no stage function {name!r} for application kind {kind!r}") from None


def _load_builtin() -> None:
    from onepiece.stage.wan import functions  # noqa: F401  (registers the Wan2.1 stages)
