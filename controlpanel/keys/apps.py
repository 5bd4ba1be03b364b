from django.apps import AppConfig


class KeysConfig(AppConfig):
    name = "controlpanel.keys"
    label = "cp_keys"
    verbose_name = "Client API keys"
