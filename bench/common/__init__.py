"""What several benchmarks share that is not process management (that is ``harness/``): the
report's output (:mod:`.output`), the wire constants of an OpenAI stream (:mod:`.wire`), the
router's admin API as the benchmarks drive it (:mod:`.router_api`), the floor proxy
(:mod:`.floor_proxy`, started by :mod:`.floor`) and plain ``WorkerView`` builders
(:mod:`.workers`).
"""
