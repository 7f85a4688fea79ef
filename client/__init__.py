"""commitgate.client: guarded MCP tool calls with keys from durable state.

    from commitgate.client import Gate, PossibleDuplicate

    gate = Gate(client, session=run_id)          # an mcp Client or ClientSession
    charge = await gate.call("charge_card", {"card": "4242", "amount_cents": 1299}, step="charge")

The same run id and step always name the same operation, so a retried, crashed or restarted run
gets the first outcome back instead of acting twice. Needs only `mcp`, none of the server's extras.
"""

from commitgate.client.errors import (
    ApprovalDenied,
    BudgetExceeded,
    CommitgateError,
    KeyReused,
    OperationFailed,
    OutcomeUnknown,
    PossibleDuplicate,
    StillRunning,
)
from commitgate.client.gate import OPERATION_META, SESSION_META, STEP_META, Backoff, Gate, GateResult

__all__ = [
    "OPERATION_META",
    "SESSION_META",
    "STEP_META",
    "ApprovalDenied",
    "Backoff",
    "BudgetExceeded",
    "CommitgateError",
    "Gate",
    "GateResult",
    "KeyReused",
    "OperationFailed",
    "OutcomeUnknown",
    "PossibleDuplicate",
    "StillRunning",
]
