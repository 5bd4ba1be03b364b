"""Bounds of the admin API's input, shared by every router module."""

from controlpanel.registry.models import Worker

# Bounds of the columns input lands in: past them PostgreSQL refuses the write (a 500),
# where SQLite would have stored it. MAX_INT is PostgreSQL's integer, Django's IntegerField.
MAX_INT = 2**31 - 1
MAX_URL = Worker._meta.get_field("url").max_length
MAX_WORKER_NAME = Worker._meta.get_field("name").max_length
