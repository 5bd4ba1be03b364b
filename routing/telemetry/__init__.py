"""What the router tells about itself: metrics, traces, the access log and explanations.

Owns: the router's /metrics (metrics, with admission_metrics, shared_metrics, gpu_metrics
and vllm_metrics for their families), OpenTelemetry spans (tracing), the structured
access log and request ids (access_log), routing explained per request, as a dry run and
live (explain), and cache predictions checked against the workers' answers (cache_check).

May import: every room below the request path (prompt, policies, kv, admission, clients,
peers, fleet) to read their state, never routing.proxy or routing.router: what it reads
from the router it names in a small protocol of its own (metrics.RouterView).
"""
