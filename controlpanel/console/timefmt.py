"""One way to write a time on every page: "2026-12-01 09:30:12 UTC", in the deployment's
zone (TIME_ZONE) and always naming it, so an operator comparing the events page with a log
or a colleague's screenshot never has to guess. Chart axes use the short clock form
("09:30"), with the zone said once in the chart's caption (`zone_name`)."""

from __future__ import annotations

from datetime import UTC, datetime

from django.utils import timezone

FORMAT = "%Y-%m-%d %H:%M:%S %Z"


def _local(value: datetime | float | int) -> datetime:
    if isinstance(value, int | float):
        value = datetime.fromtimestamp(value, tz=UTC)
    if timezone.is_naive(value):
        value = timezone.make_aware(value, UTC)
    return timezone.localtime(value)


def time_label(value: datetime | float | int) -> str:
    """The one format: date, time to the second, and the zone's name."""
    return _local(value).strftime(FORMAT)


def clock_label(value: datetime | float | int) -> str:
    return _local(value).strftime("%H:%M")


def zone_name() -> str:
    return timezone.localtime(timezone.now()).strftime("%Z")
