"""``python -m bench.real_vllm``: see :mod:`bench.real_vllm.run`."""

from bench.real_vllm.run import main

raise SystemExit(main())
