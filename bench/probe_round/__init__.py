"""What one idle probe round and one periodic tick cost the Celery worker: ``python -m
bench.probe_round`` (see :mod:`bench.probe_round.run`)."""
