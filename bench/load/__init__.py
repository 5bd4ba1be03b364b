"""Load: does the router stay correct with 1,000 streams open at once, and is nothing left behind
afterwards?

Run: ``.venv/bin/python -m bench.load --help``. Modules: run (the command line, the load, the
figures), fleet (workers and router, open-file limits, the router's sockets and in-flight
count), report (the markdown, checks).
"""
