from django.apps import AppConfig


class RoutersConfig(AppConfig):
    name = "controlpanel.routers"
    label = "cp_routers"
    verbose_name = "Routers"
