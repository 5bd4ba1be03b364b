"""The benchmarks: one package each (``bench/<name>/``: its run, its library, its report), run
as ``.venv/bin/python -m bench.<name>``; what several share is in ``bench/common/`` and, for
processes, ``harness/``. See bench/README.md."""
