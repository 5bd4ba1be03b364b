"""Which paths the router serves, and how: forwarded by the body's `model`, or shielded.

Everything else goes to Django (controlpanel.asgi asks :func:`routes_here`). Each entry
says why it is forwarded or shielded; vLLM's own route list (vllm-captures/observed.md,
docs/vllm-compat.md) is what they are checked against.
"""

from __future__ import annotations

from routing.listings import METRICS_PATH, SEED_ROUTES

# Routes forwarded by the `model` field of their JSON body.
MODEL_ROUTES = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/messages",
        "/v1/rerank",
        "/v2/rerank",
        "/v1/score",
        "/tokenize",
        "/detokenize",
        "/rerank",
        "/score",
        "/pooling",
        "/classify",
        # Anthropic's API (errors in its shape: routing.errors) and vLLM's newer inference
        # routes, each a pure function of its body on any worker serving the model:
        "/v1/messages/count_tokens",
        "/v1/messages/render",  # templating and tokenizing only (--enable-scale-out)
        "/v1/chat/completions/render",
        "/v1/completions/render",
        "/v1/responses/render",
        "/v1/chat/completions/derender",  # token ids back to an answer: the model's tokenizer
        "/v1/completions/derender",
        "/v1/chat/completions/batch",
        "/inference/v1/generate",  # token in, token out; `model` as in the others
        "/generative_scoring",
        "/v1/systemone",  # vLLM's structured decisions: generation under a schema
    }
)
# vLLM's administrative and dev-mode endpoints: answered here with a 404 so that no client
# can ever put a worker to sleep or reset its cache through the public router.
PRIVATE_ROUTES = frozenset(
    {
        # Aborts by request id, which names no worker and would let one client abort
        # another's requests (the router aborts by closing the connection instead).
        "/inference/v1/abort_requests",
        "/abort_requests",
        "/is_scaling_elastic_ep",  # the engine's own scaling state: operators only
        "/adapters",  # SageMaker's LoRA load (DELETE /adapters/{name}: routes_here)
        "/fault_tolerance/apply",
        "/release_kv_cache_memory",
        "/reset_encoder_cache",
        "/sleep",
        "/wake_up",
        "/is_sleeping",
        "/reset_prefix_cache",
        "/reset_mm_cache",
        "/collective_rpc",
        "/start_profile",
        "/stop_profile",
        "/pause",
        "/resume",
        "/is_paused",
        "/update_weights",
        "/scale_elastic_ep",
        "/server_info",
        # SageMaker's catch-all: any handler picked by the body's shape, past every route
        # rule here; clients use the named routes.
        "/invocations",
    }
)


def routes_here(path: str) -> bool:
    """True for every path the router serves; everything else goes to Django."""
    return (
        path.startswith("/v1/")
        or path in MODEL_ROUTES
        or path in SEED_ROUTES
        or path in PRIVATE_ROUTES
        or path == METRICS_PATH
        or path.startswith("/adapters/")  # SageMaker's LoRA unload: a 404 here too
    )
