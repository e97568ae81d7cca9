"""One way to say what is wrong with a message: the first field a pydantic schema rejects."""

from __future__ import annotations

import re
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, Field, StrictStr, ValidationError

M = TypeVar("M", bound=BaseModel)
# A uid or a name in any message: a non-empty string, bounded, with no control characters (a
# newline in a uid split log lines) (what every role's schemas share).
MAX_NAME = 128
_CONTROL_CHARS = r"\x00-\x1f\x7f"
_CONTROL = re.compile(f"[{_CONTROL_CHARS}]")
Name = Annotated[StrictStr, Field(min_length=1, max_length=MAX_NAME, pattern=f"^[^{_CONTROL_CHARS}]+$")]


# A workflow set's name: it ends up in process names, log files, ipc socket paths and key file
# names (proxy-SET.key), so plain and short.
SET_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,31}$"


def is_name(value: Any) -> bool:
    """Whether ``value`` is a ``Name`` (checked without pydantic: on every message's path)."""
    return isinstance(value, str) and 0 < len(value) <= MAX_NAME and not _CONTROL.search(value)


def checked(model: type[M], value: Any, prefix: str = "") -> M:
    """``value`` as ``model``; ValueError ``"<prefix>.<field path>: <reason>"`` if it does not match."""
    try:
        return model.model_validate(value)
    except ValidationError as e:
        raise ValueError(first_error(e, prefix)) from None


def first_error(e: ValidationError, prefix: str = "") -> str:
    """``"<prefix>.<field path>: <reason>"`` of the first field ``e`` rejects."""
    err = e.errors()[0]
    where = ".".join(map(str, (prefix, *err["loc"]) if prefix else err["loc"])) or "value"
    return f"{where}: {err['msg']}"


def problem(model: type[BaseModel], value: Any, prefix: str = "") -> str | None:
    """None if ``value`` matches ``model``, else what ``checked`` would say."""
    try:
        checked(model, value, prefix)
    except ValueError as e:
        return str(e)
    return None
