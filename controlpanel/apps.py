from django.apps import AppConfig


class ControlPanelConfig(AppConfig):
    name = "controlpanel"
    verbose_name = "vLLM Control Panel"
    default_auto_field = "django.db.models.BigAutoField"
