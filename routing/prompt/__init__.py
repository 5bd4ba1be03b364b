"""A request's prompt as token ids, the way the vLLM worker will see them.

Owns: the local tokenizer (tokenize: a tokenizer folder's `tokenizer.json` run on a
thread), its chat template (chat_template), the cache of a chat prompt's pieces
(tokenize_segments), and the one-hop fallback to the worker's own render or /tokenize
routes (tokenize_remote) when no tokenizer folder is configured. Only kv_aware asks for
token ids; every other policy costs nothing here.

May import: routing.policies (to pick the least loaded worker to ask), routing.fleet,
routing's bottom modules (histograms), the standard library, aiohttp, tokenizers, jinja2
and prometheus_client.
"""
