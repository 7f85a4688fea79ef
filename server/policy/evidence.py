"""`[receipts]`, `[[notify]]` and `[console] public_url`: evidence of what happened, and people told."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from commitgate.server.ledger.evidence import EVENTS
from commitgate.server.model.durations import parse_duration

_ENV_ONLY = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*\}")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ReceiptsPolicy(_Strict):
    """Signed receipts of every change: the key that signs this server's chains."""

    enabled: bool = Field(
        True,
        description="false: no receipts at all (`ops verify` then says so); for measuring what they cost.",
    )
    key_file: str | None = Field(
        None,
        description="PEM (PKCS#8) Ed25519 private key; it must exist. Default: one created in the state directory.",
    )


class NotifyPolicy(_Strict):
    """One webhook: which events it hears, how they are signed and shaped."""

    url: str = Field(min_length=1, description="Where events are POSTed (http or https).")
    events: list[Literal["approval_waiting", "approval_expired", "unknown", "budget_near", "reconciled"]] = (
        Field(min_length=1, description=f"Any of {', '.join(EVENTS)}.")
    )
    secret: str = Field(min_length=1, description="HMAC-SHA256 key of the signature, written as ${NAME}.")
    format: Literal["json", "slack"] = Field(
        "json", description="'json' (the event) or 'slack' ({\"text\": ...})."
    )
    principals: list[str] | None = Field(
        None, description="Only operations of these principals (default: all)."
    )
    give_up_after: float = Field(
        86400.0, gt=0, description="Stop retrying an event this long after it happened."
    )

    @field_validator("give_up_after", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> float:
        return parse_duration(value)

    @field_validator("url")
    @classmethod
    def _http(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL")
        return value


class ConsolePolicy(_Strict):
    """The operator's console as others link to it."""

    public_url: str | None = Field(
        None, description="The console's address as people open it, for links in notifications."
    )


def literal_secrets(data: dict[str, Any]) -> list[tuple[str, str]]:
    """Where and why: a `[[notify]]` secret written into the file itself (before `${ENV}` resolution)."""
    entries = data.get("notify")
    if not isinstance(entries, list):
        return []
    return [
        (
            f"notify[{i}].secret",
            "write the secret as ${NAME} and set the environment variable NAME: a secret is never kept in the file",
        )
        for i, entry in enumerate(entries)
        if isinstance(entry, dict)
        and isinstance(entry.get("secret"), str)
        and not _ENV_ONLY.fullmatch(entry["secret"])
    ]
