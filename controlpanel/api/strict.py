"""The admin API's input schemas refuse fields they do not know: a misspelt `modles` or
`max_inflight` that is silently ignored is a mistake the operator never hears about. (The
agents' schemas stay lenient: an agent of a newer release may send more.)

They also refuse text with a NUL character anywhere (a name, a model list, a policy
config's strings): PostgreSQL cannot store one, so it would otherwise surface as a 503
"database unavailable" instead of a 422 that says what is wrong."""

from __future__ import annotations

from typing import Any

from ninja import Schema
from pydantic import ConfigDict, model_validator


class StrictIn(Schema):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="after")
    def _no_nul(self) -> StrictIn:
        for name in type(self).model_fields:
            if _has_nul(getattr(self, name)):
                raise ValueError(
                    f"`{name}` contains a NUL character (\\u0000), which no text may hold"
                )
        return self


def _has_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(_has_nul(v) for v in value)
    return False
