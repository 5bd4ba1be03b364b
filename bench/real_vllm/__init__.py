"""Real vLLM: does kv_aware keep two real vLLM CPU servers' prefix caches warmer than prefix_aware
and round_robin, and are its predictions right?

Run: ``.venv/bin/python -m bench.real_vllm --help``. Modules: run (the command line and the
runs), fleet (the two servers, the router, modes, cold caches, counters), workload (seeded
multi-turn chats, the client), report (figures, medians, the markdown).
"""
