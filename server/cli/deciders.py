"""Who a decision taken on the command line is recorded as (docs/operating.md#operating-the-ledger).

`ops approve`, `ops deny` and `ops resolve` record a decision `via = "operator"`, so the name
they record must be an operator's, never an agent's principal. A policy with operator tokens
says who the operators are: `--by` (default: the OS user) must be one of them, and one that
sees the operation's principal. A policy without any (local stdio use) has no operator
names: the OS user or `--by` is taken, unless it is a principal the policy gives an agent.
"""

from __future__ import annotations

from dataclasses import dataclass

from commitgate.server.core.requests import printable
from commitgate.server.core.resolutions import local_operator
from commitgate.server.policy.models import Policy


class NotAnOperator(Exception):
    """The name cannot be recorded as an operator's decision; the message says what to pass."""


@dataclass(frozen=True, slots=True)
class Operators:
    """The operator names of a policy with the principals each sees (None: every one), and the
    principals it gives agents."""

    sees: dict[str, frozenset[str] | None]
    agents: frozenset[str]

    @classmethod
    def of(cls, policy: Policy) -> Operators:
        sees: dict[str, frozenset[str] | None] = {}
        agents: set[str] = set()
        for token in policy.auth.tokens if policy.auth else []:
            if token.role != "operator":
                agents.add(token.principal)
            elif token.principal in sees:  # two tokens of one operator: it sees what either sees
                before, now = sees[token.principal], token.sees
                sees[token.principal] = None if before is None or now is None else before | now
            else:
                sees[token.principal] = token.sees
        if policy.server.principal:
            agents.add(policy.server.principal)
        return cls(sees, frozenset(agents))

    def name_for(self, by: str | None, principal: str) -> str:
        """The name to record for a decision on an operation of `principal`; NotAnOperator if none."""
        name = self._operator(*_named(by, "--by"), principal) if self.sees else self.person(by, "--by")
        if name == principal:  # e.g. on stdio, where the agent's principal is the OS user too
            who = f"--by {name!r}" if by is not None else f"the OS user {name!r}"
            raise NotAnOperator(
                f"{who} is the principal of the agent whose operation this is: a decision is recorded"
                " as the person who takes it, never as that agent. Pass --by YOUR_NAME"
            )
        return name

    def person(self, given: str | None, flag: str) -> str:
        """A person's name, given with `flag` or else the OS user's: never a principal the policy
        gives an agent (NotAnOperator says which flag to pass instead)."""
        name, who = _named(given, flag)
        if name in self.agents:
            raise NotAnOperator(
                f"{who} is an agent's principal in the policy: a decision is recorded as a person's,"
                f" never as the agent's it is about. Pass {flag} YOUR_NAME"
            )
        return name

    def _operator(self, name: str, who: str, principal: str) -> str:
        names = ", ".join(sorted(self.sees))
        if name not in self.sees:
            raise NotAnOperator(
                f"{who} is not an operator of the policy: a decision names one of its operator tokens'"
                f' principals (role = "operator"): pass --by with one of: {names}'
            )
        seen = self.sees[name]
        if seen is not None and principal not in seen:
            raise NotAnOperator(
                f"operator {name!r} does not decide for principal {principal!r} (its principals:"
                f" {', '.join(sorted(seen))}); pass --by with an operator who does"
            )
        return name


def _named(given: str | None, flag: str) -> tuple[str, str]:
    """The name (given with `flag`, else the OS user's) and how a message names where it came from."""
    name = local_operator() if given is None else given
    if not name.strip() or not printable(name):
        raise NotAnOperator(f"{flag} must be a name of printable characters")
    return name, (f"{flag} {name!r}" if given is not None else f"the OS user {name!r}")
