"""schemathesis against the admin and agent API, over real HTTP to the test server: every
operation in the served /api/openapi.json, with generated valid and invalid input, never
answers 5xx, and every error it answers is JSON in the OpenAI shape the router uses. Without
the right credential (none, the other token, a wrong one) no operation lets the caller in.

Bounded and deterministic: a few examples per operation, derandomized, no example database,
so CI sees the same requests on every run. Operations are destructive (delete, drain,
rollout actions) on the throw-away test database; each test seeds its own rows and the
database is emptied after it, so no test depends on another having run first.

schemathesis's own pytest loader (`schemathesis.pytest.from_fixture`) does not run under
pytest 9.2 (it sets `Function._nodeid`, gone from pytest), so each operation is a pytest
parameter and its cases come from schemathesis's Hypothesis strategies.
"""

from __future__ import annotations

import json
import re
from datetime import timedelta
from typing import Any

import httpx
import pytest
import schemathesis
from django.utils import timezone
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import Case, GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Ok
from schemathesis.core.transport import Response
from schemathesis.schemas import APIOperation, BaseSchema
from schemathesis.specs.openapi.checks import response_schema_conformance

from controlpanel.api.site import api
from controlpanel.fleet import services
from controlpanel.keys import services as keys
from controlpanel.rollouts import aliases, plans
from tests.support.common import ADMIN_HEADERS, AGENT_HEADERS
from tests.support.servers import RouterServer

pytestmark = pytest.mark.django_db(transaction=True)
# Every operation, read from the API itself at collection; the tests fuzz the served schema
# and check first that it has the same operations.
OPERATIONS = sorted(
    (method.upper(), path)
    for path, methods in api.get_openapi_schema()["paths"].items()
    for method in methods
)
ERROR_FIELDS = {"message", "type", "param", "code"}
Operation = APIOperation[Any, Any, Any, Any]


def fuzz_settings(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: a failure shows as found
        suppress_health_check=list(HealthCheck),
    )


@pytest.fixture
def seeded() -> dict[str, Any]:
    """A worker, its model, an alias, a scheduled rollout and a client key: the path
    parameters half the cases use, so drain, heartbeat, rollout actions and deletes also
    meet real rows rather than only 404s."""
    worker = services.worker_register(url="http://127.0.0.1:9", models=["fuzz-model"])
    aliases.alias_create(name="fuzz-alias", targets={"fuzz-model": 100}, actor="test")
    plan = plans.rollout_create(
        request=plans.PlanRequest(
            alias="fuzz-alias",
            to_target="fuzz-model-2",
            start_at=timezone.now() + timedelta(days=1),
        ),
        actor="test",
    )
    key = keys.api_key_create(name="fuzz-key", actor="test").record
    return {"worker_id": worker.pk, "plan_id": plan.pk, "key_id": key.pk}


@pytest.fixture
def api_schema(router: RouterServer) -> BaseSchema:
    loaded = schemathesis.openapi.from_url(router.url + "/api/openapi.json", timeout=10)
    loaded.config.update(base_url=router.url, request_timeout=10)
    served = {(op.method.upper(), op.path) for op in _operations(loaded)}
    assert served == set(OPERATIONS), "the served schema differs from the API's own"
    return loaded


def _operations(schema: BaseSchema) -> list[Operation]:
    return [result.ok() for result in schema.get_all_operations() if isinstance(result, Ok)]


def cases(operation: Operation, seeded: dict[str, Any]) -> st.SearchStrategy[Case[Operation]]:
    """Valid and invalid input, and valid input aimed at the seeded rows."""
    names = set(re.findall(r"{(\w+)}", operation.path))
    pinned = {k: v for k, v in seeded.items() if k in names}
    if "name" in names:
        pinned["name"] = "fuzz-alias" if "/aliases/" in operation.path else "fuzz-model"
    strategies = [
        operation.as_strategy(GenerationMode.POSITIVE),
        operation.as_strategy(GenerationMode.NEGATIVE),
    ]
    if pinned:
        strategies.append(operation.as_strategy(path_parameters=pinned))
    return st.one_of(strategies)


def rightful_headers(operation: Operation) -> dict[str, str]:
    """The credential each operation takes: the agent token for agent calls, else admin."""
    return AGENT_HEADERS if "agent" in (operation.tags or []) else ADMIN_HEADERS


def assert_openai_error(response: Response) -> None:
    """A 4xx or 5xx body is {"error": {"message", "type", "param", "code"}}."""
    if response.status_code < 400:
        return
    where = f"{response.request.method} {response.request.url} -> {response.status_code}"
    content_type = response.headers.get("content-type", [""])[0]
    text = response.content[:300].decode(errors="replace")
    assert content_type.startswith("application/json"), f"{where}: {text}"
    body = json.loads(response.content)
    assert isinstance(body, dict) and set(body) == {"error"}, f"{where}: {body}"
    error = body["error"]
    assert isinstance(error, dict) and set(error) == ERROR_FIELDS, f"{where}: {body}"
    assert isinstance(error["message"], str) and error["message"], f"{where}: {body}"


def find(schema: BaseSchema, method: str, path: str) -> Operation:
    operation: Operation = schema[path][method]
    return operation


@pytest.mark.parametrize(("method", "path"), OPERATIONS)
def test_with_the_right_credential_no_input_fails_on_the_server(
    api_schema: BaseSchema, seeded: dict[str, Any], method: str, path: str
) -> None:
    operation = find(api_schema, method, path)
    headers = rightful_headers(operation)

    @fuzz_settings(max_examples=12)
    @given(case=cases(operation, seeded))
    def check(case: Case[Operation]) -> None:
        response = case.call(headers=headers)
        # And a success answers what the schema promises.
        case.validate_response(response, checks=[not_a_server_error, response_schema_conformance])
        assert_openai_error(response)

    check()


@pytest.mark.parametrize(("method", "path"), OPERATIONS)
def test_without_the_right_credential_every_operation_refuses_in_openai_format(
    api_schema: BaseSchema, seeded: dict[str, Any], method: str, path: str
) -> None:
    operation = find(api_schema, method, path)
    other = ADMIN_HEADERS if rightful_headers(operation) is AGENT_HEADERS else AGENT_HEADERS
    wrong = [{}, other, {"Authorization": "Bearer not-a-token"}]

    @fuzz_settings(max_examples=3)
    @given(case=cases(operation, seeded))
    def check(case: Case[Operation]) -> None:
        for headers in wrong:
            response = case.call(headers=headers)
            case.validate_response(response, checks=[not_a_server_error])
            assert response.status_code >= 400, (
                f"{operation.label} let {headers or 'no credential'} in: {response.content!r}"
            )
            assert_openai_error(response)

    check()


def test_every_api_route_is_in_the_schema() -> None:
    """A guard on the fuzzing itself: an operation missing from the schema goes unfuzzed."""
    paths = {path for _, path in OPERATIONS}
    assert {"/api/workers", "/api/aliases", "/api/rollouts", "/api/keys", "/api/usage"} <= paths
    assert len(OPERATIONS) >= 25


def test_an_unknown_api_path_is_an_openai_404(router: RouterServer) -> None:
    response = httpx.get(router.url + "/api/no-such-thing", headers=ADMIN_HEADERS, timeout=10)
    assert response.status_code == 404
    assert set(response.json()["error"]) == ERROR_FIELDS


BIG = 2**31  # one past PostgreSQL's integer, the column of Django's IntegerField
LONG = "x" * 1000
OUT_OF_RANGE = [
    ("POST", "/api/keys", {"name": "k", "rpm": BIG}),
    ("POST", "/api/keys", {"name": "k", "tpm": 2**63}),
    (
        "POST",
        "/api/rollouts",
        {"alias": "fuzz-alias", "to_target": "t", "gates": {"min_requests": BIG}},
    ),
    ("POST", "/api/workers/{worker_id}/heartbeat", {"queue_length": BIG}),
    ("POST", "/api/workers", {"url": "http://127.0.0.1:9", "name": LONG}),
    ("POST", "/api/workers", {"url": "http://127.0.0.1:9/" + LONG}),
    ("POST", "/api/workers", {"url": "http://127.0.0.1:9", "dcgm_url": "http://h/" + LONG}),
    ("PATCH", "/api/workers/{worker_id}", {"name": LONG}),
    ("PATCH", "/api/workers/{worker_id}", {"dcgm_url": "http://h/" + LONG}),
    ("POST", "/api/workers/register", {"url": "http://127.0.0.1:9", "name": LONG, "models": ["m"]}),
    ("POST", "/api/workers/register", {"url": "http://127.0.0.1:9/" + LONG, "models": ["m"]}),
    ("POST", "/api/workers/register", {"url": "http://127.0.0.1:9", "models": [LONG]}),
    ("POST", "/api/workers/register", {"url": "http://127.0.0.1:9", "models": [{"id": LONG}]}),
    (
        "POST",
        "/api/workers/register",
        {"url": "http://127.0.0.1:9", "dcgm_url": "http://h/" + LONG, "models": ["m"]},
    ),
    ("POST", "/api/workers/register", {"url": "http://127.0.0.1:9", "models": [{"no": "id"}]}),
    ("POST", "/api/workers/register", {"url": "http://127.0.0.1:9", "models": [{"id": 7}]}),
]


@pytest.mark.parametrize(("method", "path", "body"), OUT_OF_RANGE)
def test_input_past_a_column_is_a_4xx_on_every_database(
    router: RouterServer, seeded: dict[str, Any], method: str, path: str, body: dict[str, Any]
) -> None:
    """Found by the fuzzing on PostgreSQL: numbers past its integer and text past a
    column's length reached the database and answered 500 (SQLite stores them)."""
    headers = AGENT_HEADERS if path.endswith(("/register", "/heartbeat")) else ADMIN_HEADERS
    url = router.url + path.format(**seeded)
    response = httpx.request(method, url, json=body, headers=headers, timeout=10)
    assert 400 <= response.status_code < 500, response.text
    assert set(response.json()["error"]) == ERROR_FIELDS
