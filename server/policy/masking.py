"""Secrets out of what commands print: passwords in URLs, credential headers, key-like query values.

`policy show` prints the effective policy; a literal secret written in the file (rather than a
`${ENV}` reference) must not reach a terminal, a ticket or a screenshot. What is masked keeps its
place, so the reader still sees that something is set there.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from collections.abc import Iterable
from typing import Any

MASK = "***"

# Names of headers, query parameters and environment variables that carry credentials.
_SECRET_NAME = re.compile(
    r"auth|token|secret|passw|pwd|api[-_]?key|apikey|access[-_]?key|private|credential|cookie|signature|sig$",
    re.IGNORECASE,
)


def secret_name(name: str) -> bool:
    return bool(_SECRET_NAME.search(name))


def mask_url(url: str) -> str:
    """The URL with its password and its credential-like query values replaced by ***."""
    if "://" not in url:  # a URL with `${ENV}` references is masked too: a literal secret may sit beside one
        return url
    try:
        parts = urllib.parse.urlsplit(url)
        password = parts.password
    except ValueError:  # not a URL after all (e.g. a bad port): show it only if nothing looks secret
        return url if "@" not in url else MASK
    masked = url
    if password is not None and not _reference(password):  # edited in place: unsplit would rewrite sqlite:///
        userinfo, _, host = parts.netloc.rpartition("@")
        masked = masked.replace(parts.netloc, f"{userinfo.partition(':')[0]}:{MASK}@{host}", 1)
    pairs = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    if any(secret_name(name) for name, _ in pairs):
        query = "&".join(
            f"{name}={MASK if secret_name(name) and not _reference(value) else value}"
            for name, value in pairs
        )
        masked = masked.replace("?" + parts.query, "?" + query, 1)
    return masked


def _reference(value: str) -> bool:
    return value.startswith("${") and value.endswith("}")


def _mask_named(values: dict[str, Any]) -> dict[str, Any]:
    return {
        name: MASK if secret_name(name) and isinstance(value, str) and "${" not in value else value
        for name, value in values.items()
    }


def _mask_args(args: list[Any]) -> list[Any]:
    """Command-line arguments: `--token=VALUE` and the value after a bare `--api-key`."""
    masked: list[Any] = []
    after_secret_flag = False
    for item in args:
        if not isinstance(item, str) or "${" in item:
            masked.append(item)
            after_secret_flag = False
            continue
        flag, equals, _ = item.partition("=")
        if after_secret_flag and not item.startswith("-"):
            masked.append(MASK)
        elif item.startswith("-") and equals and secret_name(flag):
            masked.append(f"{flag}={MASK}")
        else:
            masked.append(mask_url(item))
        after_secret_flag = item.startswith("-") and not equals and secret_name(item)
    return masked


def mask_secrets(document: Any) -> Any:
    """A copy of a policy document (as `model_dump` gives it) with its secrets masked."""
    if isinstance(document, str):
        return mask_url(document)
    if isinstance(document, list):
        return [mask_secrets(item) for item in document]
    if isinstance(document, dict):
        masked: dict[str, Any] = {}
        for key, value in document.items():
            if key in ("headers", "env") and isinstance(value, dict):
                masked[key] = _mask_named({k: mask_secrets(v) for k, v in value.items()})
            elif key == "args" and isinstance(value, list):
                masked[key] = _mask_args(value)
            else:
                masked[key] = mask_secrets(value)
        return masked
    return document


# --- values shown to people (the console): arguments, results, audit details ------------------------

# Field names whose value is a credential: hidden whole.
_SECRET_FIELD = re.compile(
    r"passw|pwd|secret|token|api[-_]?key|apikey|access[-_]?key|private[-_]?key|credential|cookie"
    r"|authori[sz]ation|^auth$|signature|^cvv|^cvc|security[-_]?code|(^|[-_])pin$|ssn|iban|account[-_]?number",
    re.IGNORECASE,
)
# A credential shorter than this is hidden under its own field name only: searched for in every text,
# "12" would hide every 12.
MIN_REPEATED_SECRET = 4
# Field names whose value is a payment card number: only its last four digits are shown.
_CARD_FIELD = re.compile(r"card|^pan$|ccn|credit", re.IGNORECASE)
# A card number written anywhere: 13 to 19 digits, possibly grouped by spaces or dashes.
_CARD_NUMBER = re.compile(r"(?<!\d)(?:\d[ -]?){12,18}\d(?!\d)")


def _luhn(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        n = int(ch)
        if i % 2:
            n = n * 2 - 9 if n > 4 else n * 2
        total += n
    return total % 10 == 0


def _last_four(value: Any) -> str:
    digits = re.sub(r"\D", "", str(value))
    return f"•••• {digits[-4:]}" if len(digits) >= 4 else MASK


def _mask_card_numbers(text: str) -> str:
    def masked(match: re.Match[str]) -> str:
        digits = re.sub(r"\D", "", match.group(0))
        return _last_four(digits) if _luhn(digits) else match.group(0)

    return _CARD_NUMBER.sub(masked, text)


def mask_values(value: Any, name: str = "", secrets: Iterable[str] = ()) -> Any:
    """A copy of `value` (JSON-like) safe to show a person: credential fields hidden, card numbers cut to
    their last four digits, whether named as such or found in any text (Luhn-valid digit runs). A
    credential's value is hidden wherever else it appears too (a text block repeating a result, JSON
    written as text), and so is each of `secrets` (found elsewhere in the same record)."""
    known = sorted(secret_values(value, name) | set(secrets), key=len, reverse=True)
    return _masked(value, name, [s for s in known if len(s) >= MIN_REPEATED_SECRET])


def secret_values(value: Any, name: str = "") -> set[str]:
    """The values held under credential fields anywhere in `value`, JSON written as text included."""
    if isinstance(value, dict):
        return set().union(*(secret_values(item, str(key)) for key, item in value.items()))
    if isinstance(value, list):
        return set().union(*(secret_values(item, name) for item in value))
    if value is None or isinstance(value, bool) or not isinstance(value, str | int | float):
        return set()
    if name and _SECRET_FIELD.search(name):
        return {str(value)}
    inside = _json_in(value)
    return secret_values(inside) if inside is not None else set()


def _json_in(value: Any) -> Any:
    """The object or list a text holds as JSON, or None."""
    if not isinstance(value, str) or not value.lstrip().startswith(("{", "[")):
        return None
    try:
        return json.loads(value)
    except (ValueError, RecursionError):
        return None


def _masked(value: Any, name: str, secrets: list[str]) -> Any:
    if isinstance(value, dict):
        return {key: _masked(item, str(key), secrets) for key, item in value.items()}
    if isinstance(value, list):
        return [_masked(item, name, secrets) for item in value]
    if value is None or isinstance(value, bool):
        return value
    if name and _SECRET_FIELD.search(name):
        return MASK
    if name and _CARD_FIELD.search(name) and isinstance(value, str | int):
        return _last_four(value)
    if not isinstance(value, str):
        return value
    inside = _json_in(value)
    if inside is not None and (shown := _masked(inside, "", secrets)) != inside:
        value = json.dumps(shown, ensure_ascii=False)  # JSON as text: its credential fields hidden too
    for secret in secrets:
        value = value.replace(secret, MASK)
    return _mask_card_numbers(value)
