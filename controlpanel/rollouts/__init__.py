"""Aliases and rollout plans: weighted public model names, and the health-gated plans that
move an alias from one target to another.

Lives here: aliases, plan creation and pre-flight checks, the transitions' state machine,
the gates, and the beat clock with its Celery task.

May import: ``controlpanel.registry``, ``controlpanel.fleet`` (a finished plan may drain the
old target's workers), ``routing.telemetry.metrics`` (the gate's TTFT buckets) and Django.
"""
