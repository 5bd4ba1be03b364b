"""Starting what the tests, the benchmarks and the launcher run beside the project.

* :mod:`harness.real_vllm`: real vLLM servers on a CPU (their venv, their model folders made
  offline, their process groups), for the real-vLLM test tier, ``bench/real_vllm.py`` and
  ``serve --demo-real``.
* ``harness/vllm_env/``: the pinned requirements and the install script of that venv, and the
  script that makes the model folders inside it.
"""
