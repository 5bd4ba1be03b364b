from django.apps import AppConfig


class RolloutsConfig(AppConfig):
    name = "controlpanel.rollouts"
    label = "cp_rollouts"
    verbose_name = "Rollouts"
