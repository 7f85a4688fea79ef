"""A python tool's arguments: validated once per attempt, as its annotations say; a retry gets values of its own."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from support import validated_tool

from commitgate.server.policy.loading import loads_policy
from commitgate.server.serve.gateway import Gateway

pytestmark = pytest.mark.anyio

POLICY = """
[ledger]
url = "sqlite:///{ledger}"
synchronous = "NORMAL"
[tools.pack]
class = "key-required"
python = "support.validated_tool:pack"
retry = {{ attempts = 2, initial = "0s", max = "0s" }}
"""


@pytest.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[Gateway]:
    validated_tool.VALIDATIONS[0], validated_tool.FAIL_FIRST[0] = 0, 0
    validated_tool.RECEIVED.clear()
    gw = await Gateway.open(loads_policy(POLICY.format(ledger=tmp_path / "ledger.db")), None)
    try:
        yield gw
    finally:
        await gw.close()


async def test_a_call_validates_its_arguments_once(gateway: Gateway) -> None:
    result = await gateway.call_tool("pack", {"items": ["a", "b"], "idempotency_key": "p-1"}, {}, "alice")
    assert not result.is_error, result
    assert validated_tool.RECEIVED == [["a", "b"]]
    assert validated_tool.VALIDATIONS[0] == 1


async def test_a_retry_gets_the_arguments_afresh_not_what_the_first_attempt_changed(gateway: Gateway) -> None:
    validated_tool.FAIL_FIRST[0] = 1
    result = await gateway.call_tool("pack", {"items": ["a", "b"], "idempotency_key": "p-2"}, {}, "alice")
    assert not result.is_error, result
    assert result.structured_content == {"packed": 2}
    assert validated_tool.RECEIVED == [["a", "b"], ["a", "b"]]  # two attempts, the same items each
    assert validated_tool.VALIDATIONS[0] == 2


async def test_the_constraints_of_an_annotated_parameter_are_schema_and_validation(gateway: Gateway) -> None:
    (listed,) = [t for t in gateway.list_tools() if t.name == "pack"]
    assert listed.input_schema["properties"]["boxes"]["exclusiveMinimum"] == 0
    result = await gateway.call_tool(
        "pack", {"items": ["a"], "boxes": 0, "idempotency_key": "p-3"}, {}, "alice"
    )
    assert result.is_error and result.structured_content is not None
    assert result.structured_content["error"]["code"] == "invalid_arguments"
    assert "boxes" in result.structured_content["error"]["message"]
    assert validated_tool.RECEIVED == []  # nothing ran


def test_validated_arguments_are_the_models_json_dump() -> None:
    """`validate` takes the model's validator and serializer directly: same values as model_dump(mode="json")."""
    import datetime
    import decimal
    import uuid

    from commitgate.server.policy.models import Policy, ToolPolicy
    from commitgate.tools.base import Collaborators
    from commitgate.tools.python import PythonTool

    policy = ToolPolicy.model_validate({"class": "safe-retry", "python": "support.validated_tool:typed"})
    tool = PythonTool("typed", policy, Policy(), Collaborators())
    given = {"when": "2026-12-03T21:00:00Z", "amount": "1.50", "id": str(uuid.UUID(int=7)), "tags": ("a",)}
    validated = tool.validate(given)
    model = tool.signature.model.model_validate(given)
    assert validated == model.model_dump(mode="json")
    assert validated == {
        "when": "2026-12-03T21:00:00Z",
        "amount": "1.50",
        "id": str(uuid.UUID(int=7)),
        "tags": ["a"],
    }
    held = model.model_dump()  # the model holds Python values; only the validated arguments are JSON
    assert isinstance(held["when"], datetime.datetime) and isinstance(held["amount"], decimal.Decimal)
