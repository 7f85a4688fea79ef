"""Canonical JSON is exactly what `json.dumps` with the canonical options writes, errors included."""

from __future__ import annotations

import json
from typing import Any

import pytest

from commitgate.server.model.canonical import canonical_json


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@pytest.mark.parametrize(
    "value",
    [
        {"n": 12345, "idempotency_key": "k-1"},
        {"b": [1, 2.5, -0.0, 1e300, None, True, False], "a": {"z": 'é\n"\\', "y": "😀\u2028"}},
        {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")},
        "just a string with ü",
        [],
        {},
        3,
        {2: "int keys are written as strings", 1: None},
    ],
)
def test_the_text_is_json_dumps_with_the_canonical_options(value: Any) -> None:
    assert canonical_json(value) == _dumps(value)


def test_a_circular_value_is_refused_every_time_and_the_next_value_still_encodes() -> None:
    looped: list[Any] = []
    looped.append(looped)
    for _ in range(2):  # the markers of a failed call never leak into the next one
        with pytest.raises(ValueError, match="Circular reference"):
            canonical_json({"a": looped})
    shared = [1]
    assert canonical_json({"x": shared, "y": shared}) == '{"x":[1],"y":[1]}'  # repeated, not circular


def test_a_value_json_cannot_write_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="not JSON serializable"):
        canonical_json({"x": object()})
    assert canonical_json({"ok": 1}) == '{"ok":1}'
