"""simulator.endpoints through a served app: embeddings, tokenize round trips, /v1/models and
LoRA loading, health and the /sim/* hooks, the request log."""

from __future__ import annotations

import math

from simulator.gpus import SERIES
from tests.support.sim_app import Served, drive


def test_embeddings_are_deterministic_unit_vectors_one_per_input() -> None:
    async def scenario(s: Served) -> None:
        status, body = await s.post("/v1/embeddings", {"input": ["a b", "c"]})
        assert status == 200 and [d["index"] for d in body["data"]] == [0, 1]
        vector = body["data"][0]["embedding"]
        assert math.isclose(sum(v * v for v in vector), 1.0, rel_tol=1e-9)
        _, again = await s.post("/v1/embeddings", {"input": "a b"})
        assert again["data"][0]["embedding"] == vector
        assert body["usage"]["prompt_tokens"] == 3
        assert (await s.post("/v1/embeddings", {"input": []}))[0] == 400

    drive(scenario)


def test_tokenize_then_detokenize_gives_the_words_back() -> None:
    async def scenario(s: Served) -> None:
        _, tokens = await s.post("/tokenize", {"prompt": "hello brave world"})
        assert tokens["count"] == 3 and tokens["max_model_len"] == 4096
        _, text = await s.post("/detokenize", {"tokens": tokens["tokens"]})
        assert text == {"prompt": "hello brave world"}
        _, chat = await s.post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
        assert chat["count"] == 2  # the role, then the word
        status, error = await s.post("/detokenize", {"tokens": ["x"]})
        assert status == 400 and error["error"]["param"] == "tokens"

    drive(scenario)


def test_loras_load_into_the_model_list_and_unload() -> None:
    async def scenario(s: Served) -> None:
        status, text = await s.post(
            "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/a/sql"}
        )
        assert status == 200 and "added" in text
        _, models = await s.get("/v1/models")
        cards = {m["id"]: m for m in models["data"]}
        assert cards["sim-model"]["max_model_len"] == 4096 and cards["sim-model"]["parent"] is None
        assert (cards["sql"]["parent"], cards["sql"]["root"]) == ("sim-model", "/a/sql")
        assert cards["sql"]["max_model_len"] is None
        again = await s.post("/v1/load_lora_adapter", {"lora_name": "sql"})
        assert again[0] == 400 and again[1]["error"]["type"] == "InvalidUserInput"
        assert (await s.post("/v1/unload_lora_adapter", {"lora_name": "sql"}))[0] == 200
        assert (await s.post("/v1/unload_lora_adapter", {"lora_name": "sql"}))[0] == 404
        assert (await s.post("/v1/unload_lora_adapter", {"lora_name": "sim-model"}))[0] == 404

    drive(scenario)


def test_control_steers_health_faults_and_gpus_and_stats_show_the_log() -> None:
    async def scenario(s: Served) -> None:
        assert (await s.get("/health"))[0] == 200
        _, state = await s.post(
            "/sim/control", {"healthy": False, "fail_ratio": 7, "extra_ttft_ms": -3, "gpu_count": 0}
        )
        assert state == {"healthy": False, "fail_ratio": 1.0, "extra_ttft_ms": 0.0}
        assert (await s.get("/health"))[0] == 503 and (await s.get("/ping"))[0] == 503
        assert (await s.get("/dcgm-metrics"))[1] == "\n".join(
            f"# HELP {n} {h}\n# TYPE {n} gauge" for n, h in SERIES
        ) + "\n"
        assert (await s.post("/sim/control", b"not json"))[0] == 400
        _, stats = await s.get("/sim/stats")
        assert stats["by_path"]["/health"] == 2 and stats["by_path"]["/ping"] == 1
        assert [r["path"] for r in stats["requests"]] == ["/health", "/health", "/ping"]
        assert (await s.post("/sim/reset", {}))[1] == {"ok": True}
        assert (await s.get("/sim/stats"))[1]["by_path"] == {}

    drive(scenario)


def test_version_load_and_kv_event_sources() -> None:
    async def scenario(s: Served) -> None:
        assert (await s.get("/version"))[1] == {"version": "0.32.0"}
        assert (await s.get("/load"))[1] == {"server_load": 0}
        assert (await s.get("/kv_event_sources"))[1] == {}

    drive(scenario, version="0.32.0")


def test_the_delay_header_does_not_change_the_answer() -> None:
    async def scenario(s: Served) -> None:
        async with s.http.get("/version", headers={"X-Sim-Delay-Ms": "1"}) as resp:
            assert resp.status == 200 and (await resp.json()) == {"version": "sim"}

    drive(scenario)
