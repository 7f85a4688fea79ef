"""Receipts: signed, hash-chained evidence of every change an operation went through.

A receipt's `hash` is the hex SHA-256 of the canonical JSON (sorted keys, no whitespace, UTF-8) of
its other fields; `sig` is the Ed25519 signature of the ASCII bytes of that hex `hash`, in hex. A
`writer` is `<public key, 64 hex>.<chain id>`: the key that signs the chain, and which chain of that
key (a process, or one of its connections), so anyone holding a receipt can check its signature.
Within a writer, `seq` counts from 1 and `prev` is the `hash` of the receipt before (64 zeros for
the first). Checking needs nothing but the receipts and, to trust the signers, their public keys.
"""

from __future__ import annotations

import hashlib
import json
import json.encoder
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from commitgate.server.model.canonical import canonical_json
from commitgate.server.model.records import utc_parts

# Every field, in the order an export writes them (the hash is over the sorted keys anyway).
FIELDS = (
    "seq", "writer", "at", "operation_id", "principal", "session", "tool", "transition", "state", "actor",
    "arguments_sha256", "result_sha256", "prev", "hash", "sig",
)  # fmt: skip
SIGNED = FIELDS[:-2]  # what `hash` covers
GENESIS = "0" * 64  # the `prev` of a chain's first receipt


def canonical(value: Any) -> bytes:
    return canonical_json(value).encode()


def receipt_hash(receipt: Mapping[str, Any]) -> str:
    return hashlib.sha256(canonical({name: receipt.get(name) for name in SIGNED})).hexdigest()


# `canonical` of the signed fields, written directly: the keys in sorted order, each value as
# json.dumps writes it. Building and sorting a mapping per receipt cost more than hashing it.
_SIGNED_JSON = (
    '{{"actor":{},"arguments_sha256":{},"at":{},"operation_id":{},"prev":{},"principal":{},'
    '"result_sha256":{},"seq":{},"session":{},"state":{},"tool":{},"transition":{},"writer":{}}}'
)
_STRING: Any = json.encoder.encode_basestring  # json.dumps of a str with ensure_ascii=False (in C)


def chained_hash(
    seq: int, writer: str, at: str, operation_id: str, principal: str | None, session: str | None,
    tool: str | None, transition: str, state: str | None, actor: str | None, arguments_sha256: str | None,
    result_sha256: str | None, prev: str,
) -> str:  # fmt: skip
    """`receipt_hash` of these fields (the same bytes hashed), for the writers of a chain."""
    s = _STRING
    try:
        if type(seq) is not int:
            raise TypeError(seq)
        text = _SIGNED_JSON.format(
            "null" if actor is None else s(actor),
            "null" if arguments_sha256 is None else s(arguments_sha256),
            s(at), s(operation_id), s(prev),
            "null" if principal is None else s(principal),
            "null" if result_sha256 is None else s(result_sha256),
            seq,
            "null" if session is None else s(session),
            "null" if state is None else s(state),
            "null" if tool is None else s(tool),
            s(transition), s(writer),
        )  # fmt: skip
    except TypeError:  # a value that is not text: the general encoding
        fields = (seq, writer, at, operation_id, principal, session, tool, transition, state, actor,
                  arguments_sha256, result_sha256, prev)  # fmt: skip
        return receipt_hash(dict(zip(SIGNED, fields, strict=True)))
    return hashlib.sha256(text.encode()).hexdigest()


def digest(text: str | None) -> str | None:
    """The SHA-256 of stored text (an operation's arguments or result), hex; None for none."""
    return None if text is None else hashlib.sha256(text.encode()).hexdigest()


def at_text(ts: float) -> str:
    """A receipt's time: RFC 3339 UTC with microseconds (a string, so every JSON tool agrees on it).
    The text of `datetime.fromtimestamp(ts, UTC).isoformat(timespec="microseconds")` with a Z, its
    whole second formatted once for all the receipts of that second: two per operation."""
    second, micros = utc_parts(ts)
    return f"{second}.{micros:06d}Z"


def writer_key(writer: str) -> str:
    return writer.partition(".")[0]


def label(receipt: Mapping[str, Any]) -> str:
    return f"receipt {receipt.get('seq')} of writer {receipt.get('writer')} (operation {receipt.get('operation_id')})"


@dataclass
class Verdict:
    """What checking found: how many receipts and chains were whole, or the first problem."""

    receipts: int = 0
    chains: int = 0
    problem: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def whole(self) -> bool:
        return self.problem is None


def check_chains(
    receipts: Iterable[Mapping[str, Any]], trusted: set[str] | None = None, *, from_genesis: bool = True
) -> Verdict:
    """Check receipts given in chain order per writer (the order they were written, or an export's).

    `trusted`: public keys (hex) the signers must be among; None checks each signature against the
    key its writer names (integrity, not who). `from_genesis`: every chain must begin at receipt 1
    (a ledger's); an export made `--since` a time may begin later.
    """
    verdict = Verdict()
    last: dict[str, Mapping[str, Any]] = {}
    keys: dict[str, Ed25519PublicKey | None] = {}
    for receipt in receipts:
        problem = _check_one(receipt, last.get(str(receipt.get("writer"))), trusted, keys, from_genesis)
        if problem is not None:
            verdict.problem = problem
            return verdict
        last[str(receipt["writer"])] = receipt
        verdict.receipts += 1
    verdict.chains = len(last)
    return verdict


def _check_one(
    receipt: Mapping[str, Any],
    before: Mapping[str, Any] | None,
    trusted: set[str] | None,
    keys: dict[str, Ed25519PublicKey | None],
    from_genesis: bool,
) -> str | None:
    name = label(receipt)
    missing = [f for f in FIELDS if f not in receipt]
    if missing:
        return f"{name} was edited: it lacks {', '.join(missing)}"
    if receipt_hash(receipt) != receipt["hash"]:
        return f"{name} was edited: its hash does not match its fields"
    writer = str(receipt["writer"])
    key = writer_key(writer)
    if trusted is not None and key not in trusted:
        return f"{name} was inserted: it is signed by a key that is not among the public keys given"
    if not _signed(receipt, key, keys):
        return f"{name} was edited or inserted: its signature does not match its hash"
    return _linked(receipt, before, from_genesis)


def _linked(receipt: Mapping[str, Any], before: Mapping[str, Any] | None, from_genesis: bool) -> str | None:
    """The receipt's place in its writer's chain: right after `before`, or a chain's first."""
    name, writer, seq = label(receipt), str(receipt["writer"]), receipt["seq"]
    if not isinstance(seq, int):
        return f"{name} was edited: its seq is not a number"
    if before is None:
        if from_genesis and seq != 1:
            return f"receipts 1 to {seq - 1} of writer {writer} were removed (the chain begins at {name})"
        if seq == 1 and receipt["prev"] != "0" * 64:
            return f"{name} was edited: the first receipt of a chain has no previous one"
        return None
    expected = before["seq"] + 1
    if seq < expected:
        return f"{name} is out of order or repeated: it comes after receipt {before['seq']} of its writer"
    if seq > expected:
        one = seq == expected + 1
        gap, verb = (f"receipt {expected}", "was") if one else (f"receipts {expected} to {seq - 1}", "were")
        return f"{gap} of writer {writer} {verb} removed: {name} follows {label(before)}"
    if receipt["prev"] != before["hash"]:
        return f"{name} was inserted or reordered: it does not chain to {label(before)}"
    return None


def _signed(receipt: Mapping[str, Any], key: str, keys: dict[str, Ed25519PublicKey | None]) -> bool:
    if key not in keys:
        try:
            keys[key] = Ed25519PublicKey.from_public_bytes(bytes.fromhex(key))
        except ValueError:
            keys[key] = None
    public = keys[key]
    if public is None:
        return False
    try:
        public.verify(bytes.fromhex(str(receipt["sig"])), str(receipt["hash"]).encode())
    except (InvalidSignature, ValueError):
        return False
    return True


def ordered(receipts: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Receipts grouped by writer in their chains' order, each writer's as given (a file's order)."""
    chains: dict[str, list[Mapping[str, Any]]] = {}
    for receipt in receipts:
        chains.setdefault(str(receipt.get("writer")), []).append(receipt)
    return [receipt for chain in chains.values() for receipt in chain]
