"""Celery beat's periodic work (controlpanel.envconf.periodic_schedule and
controlpanel.celery.periodic): tasks of one interval go out as one message and run in order,
and one that fails does not keep the next from its turn. The schedule itself is run by a real
beat and worker in tests/e2e (the probes, rollouts and drains that happen there)."""

from __future__ import annotations

from django.conf import settings

from controlpanel.celery import app, periodic
from controlpanel.envconf import PERIODIC_TASK, periodic_schedule

ran: list[str] = []


@app.task(name="tests.periodic.boom")
def boom() -> None:
    ran.append("boom")
    raise RuntimeError("a task that fails")


@app.task(name="tests.periodic.after")
def after() -> None:
    ran.append("after")


def test_tasks_of_one_interval_share_one_entry_in_their_order() -> None:
    schedule = periodic_schedule({"a": 5.0, "b": 2.5, "c": 5.0})
    assert schedule == {
        "every-5s": {"task": PERIODIC_TASK, "schedule": 5.0, "args": (["a", "c"],),
                     "options": {"expires": 5.0}},
        "every-2.5s": {"task": PERIODIC_TASK, "schedule": 2.5, "args": (["b"],),
                       "options": {"expires": 2.5}},
    }  # fmt: skip


def test_the_default_schedule_holds_every_periodic_task_once() -> None:
    app.loader.import_default_modules()  # the tasks a worker discovers at start
    scheduled = [n for entry in settings.CELERY_BEAT_SCHEDULE.values() for n in entry["args"][0]]
    assert sorted(scheduled) == sorted(settings.CONTROLPANEL_PERIODIC_TASKS)
    assert all(name in app.tasks for name in scheduled)
    assert periodic.name == PERIODIC_TASK


def test_a_failing_task_does_not_keep_the_next_from_its_turn() -> None:
    ran.clear()
    periodic(["tests.periodic.boom", "tests.periodic.after"])
    assert ran == ["boom", "after"]
