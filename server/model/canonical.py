"""Canonical JSON: the one text of a value that fingerprints, receipts and the ledger agree on.

Keys sorted, no spaces, UTF-8 as is (docs/contract.md#fingerprint). `json.dumps`, and even a kept
`JSONEncoder`, set up a new C encoder (and a closure) on every call: for the small values a guarded
call encodes that set-up cost more than the encoding. Here the C encoder is called directly with the
same settings, given fresh circular-reference markers each time (what `JSONEncoder` gives it), so the
text and the errors are the encoder's own.
"""

from __future__ import annotations

import json
import json.encoder
from typing import Any

_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)
_C_ENCODER: Any = getattr(json.encoder, "c_make_encoder", None)
_ESCAPE: Any = getattr(json.encoder, "c_encode_basestring", None)


def canonical_json(value: Any) -> str:
    if _C_ENCODER is None or _ESCAPE is None:  # a Python built without the C accelerator
        return _ENCODER.encode(value)
    # (markers, default, escape, indent, key separator, item separator, sort_keys, skipkeys, allow_nan)
    encode = _C_ENCODER({}, _ENCODER.default, _ESCAPE, None, ":", ",", True, False, True)
    return "".join(encode(value, 0))
