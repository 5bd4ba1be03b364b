"""NIXL agents without their progress thread: an experiment-grade workaround for CPU-only boxes.

Python imports a `sitecustomize` module found on sys.path at start-up; harness.real_vllm
puts this folder first on PYTHONPATH of a prefill or decode server, with
NIXL_NO_PROG_THREAD=1, so that every process of the server (the API server, the engine
core, its worker) runs this before vLLM.

Why: vLLM 0.32's NixlConnector always builds `nixl_agent_config(num_threads=4, ...)`, whose
UCX progress thread busy-polls one whole core (`ucp_worker_arm`, `epoll_wait(timeout=0)` in
a loop), idle or not. Two P/D servers on a 2-core machine then spin both cores: a request
took 30-110 s and the prefill side released blocks only when their 30 s lease ran out
(measured: shared/vllm-captures/pd-on-cpu.md). Without the thread, UCX makes progress when
the connector calls NIXL on each engine step: 3-7 s a request, about 0% CPU when idle.
Not a vLLM option, not tested under heavy load or long idle gaps: for tests on CPUs only.
"""

import os
import sys

if os.environ.get("NIXL_NO_PROG_THREAD") == "1":
    # A bound on the memory regions UCX's registration cache leaves unreleased between
    # progress calls, as in the measured setup.
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
    try:
        import nixl._api as _api  # type: ignore[import-not-found]  # the vLLM venv's

        _config = _api.nixl_agent_config

        def _without_progress_thread(*args: object, **kwargs: object) -> object:
            kwargs.setdefault("enable_prog_thread", False)
            return _config(*args, **kwargs)

        _api.nixl_agent_config = _without_progress_thread
    except Exception as exc:  # noqa: BLE001 (any failure: say so, start as stock vLLM)
        print(f"nixl_noprog: NIXL's progress thread stays on: {exc!r}", file=sys.stderr)
