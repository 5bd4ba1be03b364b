"""What reading one worker's /metrics costs the probe (``python -m bench.probe_parse``)."""
