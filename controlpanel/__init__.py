"""The vLLM Control Panel's Django project: wiring only.

Lives here: settings (and ``envconf``, their parsing helpers), the URL includes, the one
ASGI application, the Celery application and its embedded broker. Each domain is an app of
its own below this package:

    registry   models, migrations, events, signals, accounts, sealed secrets (the bottom)
    fleet      workers, discovery, probes and health, GPUs, LoRA, the agent
    keys       client API keys and usage
    rollouts   aliases, rollout plans, gates, the beat clock
    routers    the routers' snapshot source and what they report back
    api        the admin and agent JSON API         } on top, independent of each other
    console    the operator's pages, the live feed   }

Import rules (enforced by import-linter, see pyproject.toml): the apps are layered in that
order, ``routing`` (the data plane) imports none of them, ``simulator`` imports none of them.
"""

# The Celery application is *not* imported here, unlike in Celery's Django guide: this package
# is imported by every process of the project, the router's too, and Celery with kombu,
# billiard and their dependencies would cost each ~10 MiB it never uses. `celery -A
# controlpanel` still finds it (Celery looks for `controlpanel.celery` and its `app`), and
# the tasks modules import it, so their tasks are bound to it wherever they are sent from.
