from django.apps import AppConfig


class FleetConfig(AppConfig):
    name = "controlpanel.fleet"
    label = "cp_fleet"
    verbose_name = "Fleet"
