"""``GET /openapi.json``: a valid OpenAPI 3.1 document of the routes, which OpenEnv's
``openenv validate --url`` reads."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from openapi_pydantic import OpenAPI
from pydantic import BaseModel

from envport import Action, Env, Observation, StepResult
from envport.server import create_app
from tests.support.servers import run_env_server


class Point(BaseModel):
    x: int
    y: int


class MoveAction(Action):
    to: Point
    via: list[Point] = []


def _other_point() -> type[BaseModel]:
    class Point(BaseModel):  # another model named Point, with a different schema
        label: str

    return Point


Point2: Any = _other_point()


class MoveObservation(Observation):
    at: Point2


class MoveEnv(Env[MoveAction, MoveObservation]):
    action_type = MoveAction
    observation_type = MoveObservation

    async def on_reset(self, seed: int | None, **options: Any) -> StepResult[MoveObservation]:
        return StepResult(observation=MoveObservation(at=Point2(label="start")))

    async def on_step(self, action: MoveAction) -> StepResult[MoveObservation]:
        return StepResult(observation=MoveObservation(at=Point2(label=str(action.to.x))))


def refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return own + [r for v in node.values() for r in refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in refs(v)]
    return []


def resolve(doc: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/components/schemas/"), ref
    return doc["components"]["schemas"][ref.rsplit("/", 1)[1]]


async def fetch(env: Any) -> dict[str, Any]:
    app = create_app(env)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            r = await http.get("/openapi.json")
    assert r.status_code == 200
    doc: dict[str, Any] = r.json()
    return doc


@pytest.mark.parametrize("env", ["echo-v1", MoveEnv])
async def test_openapi_document_is_valid_and_lists_the_routes(env: Any) -> None:
    doc = await fetch(env)
    OpenAPI.model_validate(doc)  # a well-formed OpenAPI 3.1 document
    assert doc["openapi"].startswith("3.")
    assert doc["info"]["version"] == "1.0.0"
    paths = doc["paths"]
    assert {"/reset", "/step", "/state", "/health", "/schema", "/metadata"} <= set(paths)
    assert set(paths["/reset"]) == {"post"}
    assert set(paths["/step"]) == {"post"}
    assert set(paths["/state"]) == {"get"}
    assert "/ws" not in paths
    for ref in refs(doc):  # every reference resolves inside the document
        assert resolve(doc, ref) is not None


async def test_nested_models_keep_their_own_definitions() -> None:
    doc = await fetch(MoveEnv)
    body = doc["paths"]["/step"]["post"]["requestBody"]["content"]["application/json"]
    action = resolve(doc, body["schema"]["properties"]["action"]["$ref"])
    point = resolve(doc, action["properties"]["to"]["$ref"])
    assert set(point["properties"]) == {"x", "y"}
    observation = resolve(
        doc, doc["components"]["schemas"]["StepReply"]["properties"]["observation"]["$ref"]
    )
    other = resolve(doc, observation["properties"]["at"]["$ref"])
    assert set(other["properties"]) == {"label"}  # the clash was renamed, not merged


def test_openenv_validate_passes() -> None:
    from openenv.cli._validation import validate_running_environment

    with run_env_server("echo-v1") as (url, _):
        report = validate_running_environment(url)
    failed = [c for c in report["criteria"] if not c["passed"]]
    assert report["passed"], failed
    assert report["mode"] == "simulation"
    assert report["standard_profile"] == "openenv-http/1.x"
