"""The operator's console: the dashboard's pages and their partial templates, the live feed
and its websocket consumer, Django admin, and the ``serve`` and ``simulate_vllm`` commands.

May import: every domain app, ``routing`` and ``simulator`` (the demo fleet), Django and
Channels. Never the api: the API and the console are independent peers on top.
"""
