"""What `manage.py serve` costs with no traffic: CPU per process of the serve tree and of the
workers it routes to, and the router process's memory (``python -m bench.idle``)."""
