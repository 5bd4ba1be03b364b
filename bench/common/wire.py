"""What the benchmarks' load generators send and look for in an OpenAI-style stream."""

from __future__ import annotations

import re

JSON_HEADERS = {"Content-Type": "application/json"}
# A delta with at least one character of content; vLLM's first chat chunk has "content":"".
CONTENT_RE = re.compile(rb'"content":"[^"]')
DONE = b"data: [DONE]\n\n"
