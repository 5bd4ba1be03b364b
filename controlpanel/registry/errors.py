"""The one error type every service raises for a refusal meant for a person or an agent."""


class ServiceError(Exception):
    """A refusal with a message meant for the person or agent that asked. `status` is the
    HTTP status the API answers with."""

    status = 400


class InvalidTransition(ServiceError):
    status = 409


# What a database outage looks like from inside pydantic: an attribute read (a lazy queryset,
# a resolver's query) that failed is reported as a string, its exception object gone.
_DATABASE_ERRORS = ("OperationalError", "InterfaceError", "DatabaseError")


def database_failed(exc: BaseException | None) -> bool:
    """The exception, or one it was raised from or during, is the database's; so is a
    response validation that failed reading an attribute from the database."""
    from django.db import DatabaseError
    from pydantic import ValidationError

    for _ in range(10):
        if exc is None:
            return False
        if isinstance(exc, DatabaseError):
            return True
        if isinstance(exc, ValidationError) and any(
            e["type"] == "get_attribute_error" and any(n in e["msg"] for n in _DATABASE_ERRORS)
            for e in exc.errors()
        ):
            return True
        exc = exc.__cause__ or exc.__context__
    return False
