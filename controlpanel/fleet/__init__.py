"""The fleet: workers and what they serve, and how the control plane watches them.

Lives here: the worker lifecycle (add, register, heartbeat, drain, activate, remove),
discovery over HTTP, served models and their policies, the Celery probes and the health
they decide, GPU telemetry (NVML and DCGM), LoRA control, the worker agent and its command.

May import: ``controlpanel.registry``, ``routing`` (its policy registry, to validate a
policy where it is set) and Django. Never the rollouts, keys, routers, api or console apps.
"""
