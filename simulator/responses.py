"""What a generation request answers: the whole JSON body (``stream: false``) or the SSE frames
of a stream, in vLLM's field order and with its ``usage`` block. Every completion is exactly
``max_tokens`` long and finishes with reason ``length``."""

from __future__ import annotations

import time
from typing import Any

import orjson

from simulator.engine import Job
from simulator.tokens import WORDS_B, output_text

__all__ = ["SSE_HEADERS", "SseFrames", "final_body", "job_usage"]


def job_usage(job: Job) -> dict[str, Any]:
    prompt = len(job.tokens)
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + job.max_tokens,
        "completion_tokens": job.max_tokens,
        "prompt_tokens_details": None
        if job.cached_tokens is None
        else {"cached_tokens": job.cached_tokens},
    }


def final_body(job: Job, chat: bool) -> dict[str, Any]:
    text = output_text(job.max_tokens)
    if chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "tool_calls": []},
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
        }
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
            "prompt_logprobs": None,
        }
    return {
        "id": job.id,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": job.model,
        "choices": [choice],
        "usage": job_usage(job),
    }


class SseFrames:
    """Pre-encoded SSE pieces of one stream, so a token costs a few byte concatenations."""

    def __init__(self, job: Job, chat: bool) -> None:
        self.job = job
        self.chat = chat
        self.created = int(time.time())
        obj = b"chat.completion.chunk" if chat else b"text_completion"
        head = b'data: {"id":' + orjson.dumps(job.id) + b',"object":"' + obj
        head += b'","created":' + str(self.created).encode()
        head += b',"model":' + orjson.dumps(job.model) + b',"choices":[{"index":0,'
        self.head = head
        self.pre = head + (b'"delta":{"content":"' if chat else b'"text":"')
        self.mid = (b'"}' if chat else b'"') + b',"logprobs":null,"finish_reason":'
        self.tail = b',"stop_reason":null}]}\n\n'

    def first(self) -> bytes:
        token = self.token(0)
        if not self.chat:
            return token
        role = self.head + b'"delta":{"role":"assistant","content":""},"logprobs":null,'
        return role + b'"finish_reason":null}]}\n\n' + token

    def token(self, i: int) -> bytes:
        last = i == self.job.max_tokens - 1
        word = WORDS_B[i % len(WORDS_B)]
        frame = self.pre + word + self.mid + (b'"length"' if last else b"null") + self.tail
        return frame + self.end() if last else frame

    def end(self) -> bytes:
        done = b"data: [DONE]\n\n"
        if not self.job.include_usage:
            return done
        # vLLM writes this chunk with exclude_none: no `"prompt_tokens_details": null`.
        usage: dict[str, Any] = {
            "id": self.job.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.job.model,
            "choices": [],
            "usage": {k: v for k, v in job_usage(self.job).items() if v is not None},
        }
        return b"data: " + orjson.dumps(usage) + b"\n\n" + done


SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
