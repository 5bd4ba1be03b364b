"""Starting what the tests, the benchmarks and the launcher run beside the project, waiting for
it and stopping it. Nothing here imports the project (``controlpanel``, ``routing``,
``simulator``, ``launcher``, ``bench``): servers are started by their command lines. This
``__init__`` imports nothing, so ``harness.processes`` stays as light as the launcher needs.

* :mod:`harness.processes`: start a child (in a session or process group of its own, logging
  to a file, SIGTERMed should its parent die), wait for a URL or a predicate, free ports, stop
  children (SIGTERM, a deadline, SIGKILL, a group's leftovers). The standard library only:
  ``launcher.supervisor`` uses it.
* :mod:`harness.procfs`: ``/proc`` readers: CPU time, memory, a process's tree, its sockets
  and TCP connections.
* :mod:`harness.fleet`: a benchmark run's processes (routers, simulated workers, Celery) on a
  throw-away database, readiness that fails fast when a child died, the run's entry point.
* :mod:`harness.databases`: a PostgreSQL database of a run's own, a PostgreSQL server of its
  own, a Redis db number flushed.
* :mod:`harness.tokenizer_folder`: Hugging Face tokenizer folders made offline.
* :mod:`harness.real_vllm`: real vLLM servers on a CPU (their venv, their model folders made
  offline, their process groups), for the real-vLLM test tier, ``bench.real_vllm`` and
  ``serve --demo-real``; ``harness/vllm_env/``: that venv's pins, its install script and the
  script that makes the model folders inside it.
* :mod:`harness.rust_routers`: vLLM's and SGLang's Rust routers, installed once per machine
  into a cached venv of their own, and their command lines (``bench.overhead``'s peers).
"""
