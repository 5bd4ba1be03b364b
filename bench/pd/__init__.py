"""Prefill/decode disaggregation against a colocated fleet of the same size (issue 28), on
simulated vLLM servers with prefill interference on: long prompts mixed with chat.

Run: ``.venv/bin/python -m bench.pd --help``. Modules: run (the command line, the rounds),
fleet (the simulated workers of every set-up, the router, registration with roles, the
bypass threshold), workload (the seeded clients: streamed chats and long prompts, TTFT and
inter-token gaps from chunk arrival times), report (per-run figures, medians, the markdown).
"""
