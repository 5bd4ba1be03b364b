"""Where the router's CPU goes on its request path: py-spy flame graphs and per-function
tables on the tiny, stream and prefix workloads (issue 29, item 1)."""
