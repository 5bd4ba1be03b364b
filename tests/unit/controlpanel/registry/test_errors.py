"""The services' refusals and the database outage test (controlpanel.registry.errors)."""

from __future__ import annotations

import pytest
from django.db import OperationalError
from pydantic import BaseModel, ValidationError

from controlpanel.registry.errors import InvalidTransition, ServiceError, database_failed


class Shown(BaseModel):
    model_config = {"from_attributes": True}
    name: str


class Row:
    @property
    def name(self) -> str:
        raise OperationalError("server closed the connection unexpectedly")


def validation_error(source: object) -> ValidationError:
    with pytest.raises(ValidationError) as caught:
        Shown.model_validate(source)
    return caught.value


def test_refusals_carry_their_status() -> None:
    assert ServiceError("x").status == 400 and InvalidTransition("x").status == 409
    assert issubclass(InvalidTransition, ServiceError)


def test_a_database_error_is_found_through_its_causes() -> None:
    assert database_failed(OperationalError("gone"))
    try:
        try:
            raise OperationalError("gone")
        except OperationalError as exc:
            raise RuntimeError("while rendering") from exc
    except RuntimeError as outer:
        assert database_failed(outer)
    assert not database_failed(ValueError("x"))
    assert not database_failed(None)


def test_a_validation_that_failed_reading_the_database_counts() -> None:
    assert database_failed(validation_error(Row()))
    assert not database_failed(validation_error({"name": 5}))


def test_a_cause_loop_ends() -> None:
    a, b = ValueError("a"), ValueError("b")
    a.__cause__, b.__cause__ = b, a
    assert database_failed(a) is False
