from django.apps import AppConfig


class ConsoleConfig(AppConfig):
    name = "controlpanel.console"
    label = "cp_console"
    verbose_name = "Operator console"

    def ready(self) -> None:
        # The registry announces committed routing changes; the live dashboard listens.
        from controlpanel.console.live import nudge_on_commit
        from controlpanel.registry.signals import routing_committed

        routing_committed.connect(nudge_on_commit, dispatch_uid="console-nudge")
