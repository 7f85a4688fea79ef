"""Canonical JSON: the one text of a value that fingerprints, receipts and the ledger agree on.

Keys sorted, no spaces, UTF-8 as is (docs/contract.md#fingerprint). One encoder serves every call:
`json.dumps` with options builds a new encoder each time, which a guarded call pays more than once.
"""

from __future__ import annotations

import json
from typing import Any

_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def canonical_json(value: Any) -> str:
    return _ENCODER.encode(value)
