"""One way to say what is wrong with a message: the first field a pydantic schema rejects."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError


def problem(model: type[BaseModel], value: Any, prefix: str = "") -> str | None:
    """None if ``value`` matches ``model``, else ``"<prefix>.<field path>: <reason>"``."""
    try:
        model.model_validate(value)
    except ValidationError as e:
        err = e.errors()[0]
        return f"{'.'.join(map(str, (prefix, *err['loc']) if prefix else err['loc'])) or 'value'}: {err['msg']}"
    return None
