"""The process supervisor behind `manage.py serve`: one listening socket, N router processes
on it, Celery and the demo fleet once each, and a clean stop.

`serve` does the Django parts (migrate, the first admin, the banner, the demo alias), then
replaces itself with `python -m launcher ...`, so none of Django's memory stays in the
supervisor. What lives here:

- `plan`: the command line (`--routers`, `--host`, `--port`, `--grace`, `--child NAME CMD`,
  `--ready-child NAME CMD` for a process started once a router answers `--ready-path`,
  `--server-child NAME LOG CMD` for a real vLLM server in a process group of its own, and
  `--url-child NAME URL CMD` for one started once URL answers, such as that server's agent);
- `listener`: binds the one listening socket the router processes inherit and share;
- `supervisor`: starts, watches and stops the children (SIGINT/SIGTERM reach every one);
- `router`: the entry point of each router child (`python -m launcher.router --fd N`),
  uvicorn serving `controlpanel.asgi:application` on the inherited socket.

What it may import: the standard library and `harness.processes` (starting a child, waiting
for a URL, stopping children and process groups: the standard library only as well).
`launcher.router` alone imports uvicorn, and only ever runs in a router child, never in the
supervisor; the application itself is loaded there by its dotted path. Nothing here imports
Django, Celery, Channels, an HTTP client or the `controlpanel`, `routing` or `simulator`
packages (an import-linter contract says so).
"""
