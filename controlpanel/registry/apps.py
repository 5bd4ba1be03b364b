from django.apps import AppConfig


class RegistryConfig(AppConfig):
    # The label the project had as a single app: its tables, content types and migration
    # history keep their names.
    name = "controlpanel.registry"
    label = "controlpanel"
    verbose_name = "vLLM Control Panel"
    default_auto_field = "django.db.models.BigAutoField"
