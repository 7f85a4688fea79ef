"""PostgreSQL ledger: the same semantics as the SQLite one, shared by replicas on many hosts.

The hot path is one round trip per ledger step: `claim` and `update` are
server-side functions (created by the migrations) that run their lookup,
compare-and-set and audit row in one implicit transaction. A claim inserts
with `ON CONFLICT DO NOTHING` and only then reads the row; it takes a row lock
only through the compare-and-set of a transition (lease over, retryable
retake, retention over), so a replay costs no write. Outcome writes match the
fencing token in their WHERE clause, so a stale owner never overwrites a newer
attempt. Sweeps (`expire_leases`, `purge`) pick rows with `FOR UPDATE SKIP
LOCKED`: several replicas may sweep at once, each row moves exactly once, and a
purge never waits on (or blocks) a claim for long, since it deletes in small
batches.

Timestamps are epoch seconds in `double precision`, like `Operation` carries
them; JSON stays text so a replay returns the recorded bytes. Migrations are
versioned in `commitgate_schema_version` and applied under a transaction-level
advisory lock, so replicas starting together apply each one exactly once. A
URL may carry server settings as query parameters (asyncpg passes unknown ones
through), e.g. `postgresql://host/db?search_path=commitgate` to keep the tables
in their own schema.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import urllib.parse
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import asyncpg

from commitgate.server.ledger import evidence, tool_definitions
from commitgate.server.ledger.base import (
    BUDGET_STATES,
    LEASE_LOST,
    AttemptStart,
    AuditEntry,
    BudgetCheck,
    Claim,
    ClaimKind,
    ClaimRequest,
    Counts,
    Lease,
    LedgerUnavailable,
    OperationFilter,
    OverBudget,
    Spent,
    SpentIn,
    StepTimer,
    Transition,
    is_outcome,
    owner_known_dead,
    timed,
)
from commitgate.server.ledger.evidence import POSTGRES_MIGRATION, Evidence, OutboxItem, Settled
from commitgate.server.ledger.filters import filter_terms
from commitgate.server.ledger.tool_definitions import Definitions, grouped, postgres_record, select_sql
from commitgate.server.model.audit import recorded_actor
from commitgate.server.model.facts import IdempotencyClass, State
from commitgate.server.model.notes import ApprovalRecord, ErrorRecord, ReconciliationNote
from commitgate.server.model.receipts import at_text, digest
from commitgate.server.model.records import Operation, ToolResult

T = TypeVar("T")

MIGRATIONS: list[str] = [
    # 1: operations, audit trail, and the claim / compare-and-set functions of the hot path
    """
    CREATE TABLE commitgate_operations (
        operation_id      text PRIMARY KEY,
        principal         text NOT NULL,
        session           text NOT NULL,
        step              text NOT NULL,
        tool              text NOT NULL,
        idempotency_class text NOT NULL,
        fingerprint       text NOT NULL,
        state             text NOT NULL,
        attempts          integer NOT NULL,
        fence             bigint NOT NULL,
        arguments         text NOT NULL,
        lease_owner       text,
        lease_expires_at  double precision,
        result            text,
        error             text,
        reconciliation    text,
        downstream_ref    text,
        retention         double precision NOT NULL,
        created_at        double precision NOT NULL,
        updated_at        double precision NOT NULL,
        completed_at      double precision,
        expires_at        double precision,
        seq               bigint GENERATED ALWAYS AS IDENTITY,
        CONSTRAINT commitgate_operations_key UNIQUE (principal, session, step)
    );
    CREATE INDEX commitgate_operations_running ON commitgate_operations (lease_expires_at)
        WHERE state = 'RUNNING';
    CREATE INDEX commitgate_operations_expiry ON commitgate_operations (expires_at)
        WHERE expires_at IS NOT NULL;
    CREATE INDEX commitgate_operations_recent ON commitgate_operations (principal, created_at);
    CREATE TABLE commitgate_audit (
        id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        operation_id text NOT NULL,
        at           double precision NOT NULL,
        event        text NOT NULL,
        from_state   text,
        to_state     text,
        fence        bigint NOT NULL,
        actor        text,
        detail       text
    );
    CREATE INDEX commitgate_audit_operation ON commitgate_audit (operation_id, id);

    -- Lookup-or-insert in one step. Each turn of the loop follows one concurrent
    -- change (a purge, a sweep, another claim's retake) and decides again.
    CREATE FUNCTION commitgate_claim(
        p_operation_id text, p_principal text, p_session text, p_step text, p_tool text,
        p_class text, p_fingerprint text, p_arguments text, p_owner text,
        p_lease double precision, p_retention double precision, p_now double precision,
        p_lease_lost text
    ) RETURNS TABLE (kind text, op commitgate_operations)
    LANGUAGE plpgsql AS $$
    DECLARE
        r commitgate_operations;
    BEGIN
        FOR turn IN 1..16 LOOP
            INSERT INTO commitgate_operations AS o (
                operation_id, principal, session, step, tool, idempotency_class, fingerprint, state,
                attempts, fence, arguments, lease_owner, lease_expires_at, retention, created_at, updated_at)
            VALUES (p_operation_id, p_principal, p_session, p_step, p_tool, p_class, p_fingerprint,
                'RUNNING', 1, 1, p_arguments, p_owner, p_now + p_lease, p_retention, p_now, p_now)
            ON CONFLICT ON CONSTRAINT commitgate_operations_key DO NOTHING
            RETURNING o.* INTO r;
            IF FOUND THEN
                INSERT INTO commitgate_audit (operation_id, at, event, from_state, to_state, fence, actor)
                VALUES (r.operation_id, p_now, 'claimed', NULL, 'RUNNING', 1, p_owner);
                RETURN QUERY SELECT 'new'::text, r;
                RETURN;
            END IF;
            SELECT o.* INTO r FROM commitgate_operations o
                WHERE o.principal = p_principal AND o.session = p_session AND o.step = p_step;
            CONTINUE WHEN NOT FOUND;  -- purged since the insert looked
            IF r.expires_at IS NOT NULL AND r.expires_at <= p_now THEN  -- past retention: gone
                DELETE FROM commitgate_operations
                    WHERE operation_id = r.operation_id AND expires_at <= p_now;
                IF FOUND THEN
                    DELETE FROM commitgate_audit WHERE operation_id = r.operation_id;
                END IF;
                CONTINUE;
            END IF;
            IF r.tool <> p_tool OR r.fingerprint <> p_fingerprint THEN
                RETURN QUERY SELECT 'conflict'::text, r;
                RETURN;
            END IF;
            IF r.state = 'RUNNING' AND r.lease_expires_at <= p_now THEN
                UPDATE commitgate_operations AS o SET state = 'UNKNOWN', lease_owner = NULL,
                        lease_expires_at = NULL, updated_at = p_now, error = p_lease_lost
                    WHERE o.operation_id = r.operation_id AND o.fence = r.fence AND o.state = 'RUNNING'
                        AND o.lease_expires_at <= p_now
                    RETURNING o.* INTO r;
                CONTINUE WHEN NOT FOUND;  -- renewed or moved meanwhile
                INSERT INTO commitgate_audit (operation_id, at, event, from_state, to_state, fence)
                VALUES (r.operation_id, p_now, 'lease_expired', 'RUNNING', 'UNKNOWN', r.fence);
            ELSIF r.state = 'FAILED_RETRYABLE' THEN  -- certainly not applied: this caller runs it again
                UPDATE commitgate_operations AS o SET state = 'RUNNING', fence = o.fence + 1,
                        attempts = o.attempts + 1, lease_owner = p_owner, lease_expires_at = p_now + p_lease,
                        error = NULL, updated_at = p_now, completed_at = NULL, expires_at = NULL
                    WHERE o.operation_id = r.operation_id AND o.fence = r.fence
                        AND o.state = 'FAILED_RETRYABLE'
                    RETURNING o.* INTO r;
                CONTINUE WHEN NOT FOUND;  -- another caller retook it first
                INSERT INTO commitgate_audit (operation_id, at, event, from_state, to_state, fence)
                VALUES (r.operation_id, p_now, 'retry_claimed', 'FAILED_RETRYABLE', 'RUNNING', r.fence);
                RETURN QUERY SELECT 'new'::text, r;
                RETURN;
            END IF;
            RETURN QUERY SELECT 'existing'::text, r;
            RETURN;
        END LOOP;
        RAISE EXCEPTION 'commitgate_claim: operation %/%/% kept changing', p_principal, p_session, p_step;
    END $$;

    -- Compare-and-set with its audit row (see base.Transition).
    CREATE FUNCTION commitgate_update(
        p_operation_id text, p_to text, p_expect text[], p_fence bigint, p_event text,
        p_result text, p_error text, p_reconciliation text, p_new_lease boolean,
        p_lease_owner text, p_lease_expires_at double precision, p_terminal boolean,
        p_actor text, p_detail text, p_now double precision
    ) RETURNS SETOF commitgate_operations
    LANGUAGE plpgsql AS $$
    DECLARE
        r commitgate_operations;
        v_from text;
    BEGIN
        SELECT o.state INTO v_from FROM commitgate_operations o
            WHERE o.operation_id = p_operation_id AND o.state = ANY (p_expect)
                AND (p_fence IS NULL OR o.fence = p_fence)
            FOR UPDATE;
        IF NOT FOUND THEN
            RETURN;
        END IF;
        UPDATE commitgate_operations AS o SET
            state = p_to,
            updated_at = p_now,
            result = coalesce(p_result, o.result),
            error = CASE WHEN p_error IS NOT NULL OR p_to IN ('SUCCEEDED', 'RUNNING') THEN p_error
                         ELSE o.error END,
            reconciliation = coalesce(p_reconciliation, o.reconciliation),
            fence = o.fence + CASE WHEN p_new_lease THEN 1 ELSE 0 END,
            attempts = o.attempts + CASE WHEN p_new_lease THEN 1 ELSE 0 END,
            lease_owner = CASE WHEN p_new_lease THEN p_lease_owner
                               WHEN p_to <> 'RUNNING' THEN NULL ELSE o.lease_owner END,
            lease_expires_at = CASE WHEN p_new_lease THEN p_lease_expires_at
                                    WHEN p_to <> 'RUNNING' THEN NULL ELSE o.lease_expires_at END,
            completed_at = CASE WHEN NOT p_terminal THEN NULL
                                WHEN v_from = 'SUCCEEDED' THEN o.completed_at ELSE p_now END,
            expires_at = CASE WHEN p_terminal THEN p_now + o.retention END
        WHERE o.operation_id = p_operation_id
        RETURNING o.* INTO r;
        INSERT INTO commitgate_audit (operation_id, at, event, from_state, to_state, fence, actor, detail)
        VALUES (p_operation_id, p_now, p_event, v_from, p_to, r.fence, p_actor, p_detail);
        RETURN NEXT r;
    END $$;
    """,
    # downstream_ref was never written
    "ALTER TABLE commitgate_operations DROP COLUMN downstream_ref",
    # 3: duplicate detection. A claim of a key not seen before first looks for the same action
    # (same fingerprint, in scope, within the window) under another key. Rejecting calls take a
    # transaction-level advisory lock on (principal, session or not, fingerprint) before they
    # look, so of N identical calls with N fresh keys exactly one finds nothing and inserts;
    # the others wait for its commit and then find it. The index makes the lookup a range scan;
    # the fingerprint hashes the tool name too.
    """
    CREATE INDEX commitgate_operations_duplicates
        ON commitgate_operations (principal, fingerprint, session, created_at);

    CREATE FUNCTION commitgate_claim_checked(
        p_operation_id text, p_principal text, p_session text, p_step text, p_tool text,
        p_class text, p_fingerprint text, p_arguments text, p_owner text,
        p_lease double precision, p_retention double precision, p_now double precision,
        p_lease_lost text, p_window double precision, p_any_session boolean, p_reject boolean,
        p_confirmed boolean
    ) RETURNS TABLE (kind text, op commitgate_operations, duplicate_of text)
    LANGUAGE plpgsql AS $$
    DECLARE
        m commitgate_operations;
        c record;
    BEGIN
        PERFORM 1 FROM commitgate_operations o
            WHERE o.principal = p_principal AND o.session = p_session AND o.step = p_step
                AND (o.expires_at IS NULL OR o.expires_at > p_now);
        IF NOT FOUND THEN  -- a new key: is it the same action as a recent one?
            IF p_reject AND NOT p_confirmed THEN
                PERFORM pg_advisory_xact_lock(hashtextextended('commitgate.duplicates:' || p_principal
                    || chr(31) || CASE WHEN p_any_session THEN '' ELSE p_session END
                    || chr(31) || p_fingerprint, 0));
            END IF;
            IF p_any_session THEN
                SELECT o.* INTO m FROM commitgate_operations o
                    WHERE o.principal = p_principal AND o.fingerprint = p_fingerprint
                        AND o.created_at > p_now - p_window
                        AND o.state IN ('PENDING', 'RUNNING', 'SUCCEEDED', 'UNKNOWN', 'AWAITING_APPROVAL')
                        AND (o.expires_at IS NULL OR o.expires_at > p_now)
                        AND NOT (o.session = p_session AND o.step = p_step)
                    ORDER BY o.created_at DESC LIMIT 1;
            ELSE
                SELECT o.* INTO m FROM commitgate_operations o
                    WHERE o.principal = p_principal AND o.fingerprint = p_fingerprint
                        AND o.session = p_session AND o.created_at > p_now - p_window
                        AND o.state IN ('PENDING', 'RUNNING', 'SUCCEEDED', 'UNKNOWN', 'AWAITING_APPROVAL')
                        AND (o.expires_at IS NULL OR o.expires_at > p_now)
                        AND o.step <> p_step
                    ORDER BY o.created_at DESC LIMIT 1;
            END IF;
            IF m.operation_id IS NOT NULL AND p_reject AND NOT p_confirmed THEN
                RETURN QUERY SELECT 'duplicate'::text, m, NULL::text;
                RETURN;
            END IF;
        END IF;
        SELECT * INTO c FROM commitgate_claim(p_operation_id, p_principal, p_session, p_step, p_tool,
            p_class, p_fingerprint, p_arguments, p_owner, p_lease, p_retention, p_now, p_lease_lost);
        IF m.operation_id IS NOT NULL AND c.kind = 'new' THEN  -- allowed: the match goes in the audit
            INSERT INTO commitgate_audit (operation_id, at, event, from_state, to_state, fence, actor, detail)
            VALUES ((c.op).operation_id, p_now, 'possible_duplicate', NULL, 'RUNNING', 1, p_owner,
                json_build_object('duplicate_of', m.operation_id, 'confirmed', p_confirmed)::text);
            RETURN QUERY SELECT c.kind, c.op, m.operation_id;
            RETURN;
        END IF;
        RETURN QUERY SELECT c.kind, c.op, NULL::text;
    END $$;
    """,
    # 4: approvals. An operation waiting for a person's decision keeps it in `approval` (JSON);
    # the sweep finds the waits that ran out through the partial index. A claim that needs
    # approval inserts the row AWAITING_APPROVAL (no attempt, no lease); any other outcome of the
    # insert (the key exists) is the plain claim's. The compare-and-set also writes a decision.
    """
    ALTER TABLE commitgate_operations ADD COLUMN approval text,
        ADD COLUMN approval_expires_at double precision;
    CREATE INDEX commitgate_operations_awaiting ON commitgate_operations (approval_expires_at)
        WHERE state = 'AWAITING_APPROVAL';

    CREATE FUNCTION commitgate_claim_awaiting(
        p_operation_id text, p_principal text, p_session text, p_step text, p_tool text,
        p_class text, p_fingerprint text, p_arguments text, p_owner text,
        p_lease double precision, p_retention double precision, p_now double precision,
        p_lease_lost text, p_approval text, p_approval_expires_at double precision,
        p_window double precision, p_any_session boolean, p_reject boolean, p_confirmed boolean
    ) RETURNS TABLE (kind text, op commitgate_operations, duplicate_of text)
    LANGUAGE plpgsql AS $$
    DECLARE
        r commitgate_operations;
        m commitgate_operations;
    BEGIN
        WITH gone AS (  -- a record past retention no longer holds the key
            DELETE FROM commitgate_operations o
                WHERE o.principal = p_principal AND o.session = p_session AND o.step = p_step
                    AND o.expires_at <= p_now
                RETURNING o.operation_id)
        DELETE FROM commitgate_audit a USING gone g WHERE a.operation_id = g.operation_id;
        IF p_window IS NOT NULL THEN  -- duplicate detection, exactly as commitgate_claim_checked
            PERFORM 1 FROM commitgate_operations o
                WHERE o.principal = p_principal AND o.session = p_session AND o.step = p_step;
            IF NOT FOUND THEN
                IF p_reject AND NOT p_confirmed THEN
                    PERFORM pg_advisory_xact_lock(hashtextextended('commitgate.duplicates:' || p_principal
                        || chr(31) || CASE WHEN p_any_session THEN '' ELSE p_session END
                        || chr(31) || p_fingerprint, 0));
                END IF;
                SELECT o.* INTO m FROM commitgate_operations o
                    WHERE o.principal = p_principal AND o.fingerprint = p_fingerprint
                        AND (p_any_session OR o.session = p_session)
                        AND o.created_at > p_now - p_window
                        AND o.state IN ('PENDING', 'RUNNING', 'SUCCEEDED', 'UNKNOWN', 'AWAITING_APPROVAL')
                        AND (o.expires_at IS NULL OR o.expires_at > p_now)
                        AND NOT (o.session = p_session AND o.step = p_step)
                    ORDER BY o.created_at DESC LIMIT 1;
                IF m.operation_id IS NOT NULL AND p_reject AND NOT p_confirmed THEN
                    RETURN QUERY SELECT 'duplicate'::text, m, NULL::text;
                    RETURN;
                END IF;
            END IF;
        END IF;
        INSERT INTO commitgate_operations AS o (
            operation_id, principal, session, step, tool, idempotency_class, fingerprint, state,
            attempts, fence, arguments, retention, created_at, updated_at, approval, approval_expires_at)
        VALUES (p_operation_id, p_principal, p_session, p_step, p_tool, p_class, p_fingerprint,
            'AWAITING_APPROVAL', 0, 0, p_arguments, p_retention, p_now, p_now, p_approval,
            p_approval_expires_at)
        ON CONFLICT ON CONSTRAINT commitgate_operations_key DO NOTHING
        RETURNING o.* INTO r;
        IF FOUND THEN
            INSERT INTO commitgate_audit (operation_id, at, event, from_state, to_state, fence, actor)
            VALUES (r.operation_id, p_now, 'approval_requested', NULL, 'AWAITING_APPROVAL', 0, p_owner);
            IF m.operation_id IS NOT NULL THEN  -- allowed or confirmed: the match goes in the audit
                INSERT INTO commitgate_audit (operation_id, at, event, from_state, to_state, fence, actor, detail)
                VALUES (r.operation_id, p_now, 'possible_duplicate', NULL, 'AWAITING_APPROVAL', 0, p_owner,
                    json_build_object('duplicate_of', m.operation_id, 'confirmed', p_confirmed)::text);
            END IF;
            RETURN QUERY SELECT 'awaiting'::text, r, m.operation_id;
            RETURN;
        END IF;
        RETURN QUERY SELECT c.kind, c.op, NULL::text FROM commitgate_claim(p_operation_id, p_principal,
            p_session, p_step, p_tool, p_class, p_fingerprint, p_arguments, p_owner, p_lease, p_retention,
            p_now, p_lease_lost) c;
    END $$;

    DROP FUNCTION commitgate_update(text, text, text[], bigint, text, text, text, text, boolean, text,
        double precision, boolean, text, text, double precision);
    -- Compare-and-set with its audit row (see base.Transition).
    CREATE FUNCTION commitgate_update(
        p_operation_id text, p_to text, p_expect text[], p_fence bigint, p_event text,
        p_result text, p_error text, p_reconciliation text, p_new_lease boolean,
        p_lease_owner text, p_lease_expires_at double precision, p_terminal boolean,
        p_actor text, p_detail text, p_now double precision, p_approval text
    ) RETURNS SETOF commitgate_operations
    LANGUAGE plpgsql AS $$
    DECLARE
        r commitgate_operations;
        v_from text;
    BEGIN
        SELECT o.state INTO v_from FROM commitgate_operations o
            WHERE o.operation_id = p_operation_id AND o.state = ANY (p_expect)
                AND (p_fence IS NULL OR o.fence = p_fence)
            FOR UPDATE;
        IF NOT FOUND THEN
            RETURN;
        END IF;
        UPDATE commitgate_operations AS o SET
            state = p_to,
            updated_at = p_now,
            result = coalesce(p_result, o.result),
            error = CASE WHEN p_error IS NOT NULL OR p_to IN ('SUCCEEDED', 'RUNNING') THEN p_error
                         ELSE o.error END,
            reconciliation = coalesce(p_reconciliation, o.reconciliation),
            approval = coalesce(p_approval, o.approval),
            fence = o.fence + CASE WHEN p_new_lease THEN 1 ELSE 0 END,
            attempts = o.attempts + CASE WHEN p_new_lease THEN 1 ELSE 0 END,
            lease_owner = CASE WHEN p_new_lease THEN p_lease_owner
                               WHEN p_to <> 'RUNNING' THEN NULL ELSE o.lease_owner END,
            lease_expires_at = CASE WHEN p_new_lease THEN p_lease_expires_at
                                    WHEN p_to <> 'RUNNING' THEN NULL ELSE o.lease_expires_at END,
            completed_at = CASE WHEN NOT p_terminal THEN NULL
                                WHEN v_from = 'SUCCEEDED' THEN o.completed_at ELSE p_now END,
            expires_at = CASE WHEN p_terminal THEN p_now + o.retention END
        WHERE o.operation_id = p_operation_id
        RETURNING o.* INTO r;
        INSERT INTO commitgate_audit (operation_id, at, event, from_state, to_state, fence, actor, detail)
        VALUES (p_operation_id, p_now, p_event, v_from, p_to, r.fence, p_actor, p_detail);
        RETURN NEXT r;
    END $$;
    """,
    # 5: budgets. Each operation of a budgeted tool carries its budget's name and the amount it
    # spends; its scope is its own principal and session. A claim that may execute (a key not seen
    # before, or a retryable one taken again) takes a transaction-level advisory lock on its budget
    # scope, adds up what the scope spent within the window and claims only if its amount fits:
    # concurrent claims of one scope queue on the lock, each sees the rows of those before it, and
    # claims of other scopes or of unbudgeted tools never wait. The index covers the sum. A call that
    # needs approval is checked the same way when it arrives and recorded AWAITING_APPROVAL with its
    # amount, which counts once a person approves it (PENDING onwards). With `exceeded = "approval"`
    # (p_over_approval set) a call that does not fit waits for a person instead of being refused,
    # its approval record and its audit holding the budget, its limit, what is spent and its amount.
    """
    ALTER TABLE commitgate_operations ADD COLUMN budget text, ADD COLUMN budget_amount double precision;
    CREATE INDEX commitgate_operations_budget
        ON commitgate_operations (budget, principal, session, created_at)
        INCLUDE (state, budget_amount, expires_at) WHERE budget IS NOT NULL;

    CREATE FUNCTION commitgate_claim_budgeted(
        p_operation_id text, p_principal text, p_session text, p_step text, p_tool text,
        p_class text, p_fingerprint text, p_arguments text, p_owner text,
        p_lease double precision, p_retention double precision, p_now double precision,
        p_lease_lost text, p_duplicates boolean, p_window double precision, p_any_session boolean,
        p_reject boolean, p_confirmed boolean, p_budget text, p_per text, p_amount double precision,
        p_limit double precision, p_budget_window double precision, p_approval text,
        p_approval_expires_at double precision, p_over_approval text,
        p_over_approval_expires_at double precision
    ) RETURNS TABLE (kind text, op commitgate_operations, duplicate_of text, spent double precision)
    LANGUAGE plpgsql AS $$
    DECLARE
        e commitgate_operations;
        v_spent double precision;
        v_may_spend boolean;
        v_over jsonb;
        c record;
    BEGIN
        SELECT o.* INTO e FROM commitgate_operations o
            WHERE o.principal = p_principal AND o.session = p_session AND o.step = p_step
                AND (o.expires_at IS NULL OR o.expires_at > p_now);
        v_may_spend := NOT FOUND OR e.state = 'FAILED_RETRYABLE';  -- this call may execute, and spend
        IF v_may_spend THEN
            PERFORM pg_advisory_xact_lock(hashtextextended('commitgate.budget:' || p_budget
                || chr(31) || CASE WHEN p_per = 'all' THEN '' ELSE p_principal END
                || chr(31) || CASE WHEN p_per = 'session' THEN p_session ELSE '' END, 0));
            -- a concurrent call of the same key may have claimed it while this one waited
            SELECT o.* INTO e FROM commitgate_operations o
                WHERE o.principal = p_principal AND o.session = p_session AND o.step = p_step
                    AND (o.expires_at IS NULL OR o.expires_at > p_now);
            v_may_spend := NOT FOUND OR e.state = 'FAILED_RETRYABLE';
        END IF;
        IF v_may_spend THEN
            SELECT coalesce(sum(o.budget_amount), 0) INTO v_spent FROM commitgate_operations o
                WHERE o.budget = p_budget
                    AND (p_per = 'all' OR o.principal = p_principal)
                    AND (p_per <> 'session' OR o.session = p_session)
                    AND o.created_at > p_now - p_budget_window
                    AND o.state IN ('PENDING', 'RUNNING', 'SUCCEEDED', 'UNKNOWN')
                    AND (o.expires_at IS NULL OR o.expires_at > p_now);
            IF v_spent + p_amount > p_limit AND p_over_approval IS NULL THEN
                RETURN QUERY SELECT 'over_budget'::text, NULL::commitgate_operations, NULL::text, v_spent;
                RETURN;
            ELSIF v_spent + p_amount > p_limit THEN  -- exceeded = "approval": a person decides
                v_over := jsonb_build_object('name', p_budget, 'limit', p_limit, 'spent', v_spent,
                    'amount', p_amount);
                p_approval := (p_over_approval::jsonb || jsonb_build_object('over_budget', v_over))::text;
                p_approval_expires_at := p_over_approval_expires_at;
                IF e.operation_id IS NOT NULL THEN  -- a retryable operation taken again waits instead
                    UPDATE commitgate_operations AS o SET state = 'AWAITING_APPROVAL', lease_owner = NULL,
                            lease_expires_at = NULL, approval = p_approval,
                            approval_expires_at = p_approval_expires_at, updated_at = p_now,
                            completed_at = NULL, expires_at = NULL
                        WHERE o.operation_id = e.operation_id AND o.fence = e.fence
                            AND o.state = 'FAILED_RETRYABLE'
                        RETURNING o.* INTO e;
                    IF FOUND THEN
                        INSERT INTO commitgate_audit (operation_id, at, event, from_state, to_state, fence, actor)
                        VALUES (e.operation_id, p_now, 'approval_requested', 'FAILED_RETRYABLE',
                            'AWAITING_APPROVAL', e.fence, p_owner);
                        INSERT INTO commitgate_audit (operation_id, at, event, from_state, to_state, fence, actor,
                            detail)
                        VALUES (e.operation_id, p_now, 'budget_exceeded', NULL, 'AWAITING_APPROVAL', e.fence,
                            p_owner, v_over::text);
                        RETURN QUERY SELECT 'awaiting'::text, e, NULL::text, v_spent;
                        RETURN;
                    END IF;
                END IF;
            END IF;
        END IF;
        IF p_approval IS NOT NULL THEN
            SELECT * INTO c FROM commitgate_claim_awaiting(p_operation_id, p_principal, p_session, p_step,
                p_tool, p_class, p_fingerprint, p_arguments, p_owner, p_lease, p_retention, p_now,
                p_lease_lost, p_approval, p_approval_expires_at,
                CASE WHEN p_duplicates THEN p_window END, p_any_session, p_reject, p_confirmed);
        ELSIF p_duplicates THEN
            SELECT * INTO c FROM commitgate_claim_checked(p_operation_id, p_principal, p_session, p_step,
                p_tool, p_class, p_fingerprint, p_arguments, p_owner, p_lease, p_retention, p_now,
                p_lease_lost, p_window, p_any_session, p_reject, p_confirmed);
        ELSE
            SELECT x.kind, x.op, NULL::text AS duplicate_of INTO c FROM commitgate_claim(p_operation_id,
                p_principal, p_session, p_step, p_tool, p_class, p_fingerprint, p_arguments, p_owner,
                p_lease, p_retention, p_now, p_lease_lost) x;
        END IF;
        IF c.kind IN ('new', 'awaiting') THEN
            UPDATE commitgate_operations AS o SET budget = p_budget, budget_amount = p_amount
                WHERE o.operation_id = (c.op).operation_id
                RETURNING o.* INTO e;
            IF c.kind = 'awaiting' AND v_over IS NOT NULL THEN  -- waits because it is past its budget
                INSERT INTO commitgate_audit (operation_id, at, event, from_state, to_state, fence, actor, detail)
                VALUES (e.operation_id, p_now, 'budget_exceeded', NULL, 'AWAITING_APPROVAL', e.fence, p_owner,
                    v_over::text);
            END IF;
            RETURN QUERY SELECT c.kind, e, c.duplicate_of, v_spent;
            RETURN;
        END IF;
        RETURN QUERY SELECT c.kind, c.op, c.duplicate_of, v_spent;
    END $$;
    """,
    # 6: budgets spend at the take and add exactly, and a duplicate is answered before the budget.
    # `budget_spent_at` is when an operation spent (taken to run; NULL while it waits for a person or
    # is approved and not yet taken) and places it in the window; existing records spent when they
    # were created, as they counted then. Amounts are `numeric`. The take of an approved operation
    # (`commitgate_take_budgeted`) queues on the same advisory lock as the claims of its budget
    # scope, adds up what the scope spent and takes the operation only if its amount fits. A claim
    # of a new key looks for a duplicate (under the duplicates lock) before it looks at the budget.
    """
    ALTER TABLE commitgate_operations ADD COLUMN budget_spent_at double precision;
    UPDATE commitgate_operations SET budget_spent_at = created_at
        WHERE budget IS NOT NULL AND state <> 'AWAITING_APPROVAL';
    DROP INDEX commitgate_operations_budget;
    ALTER TABLE commitgate_operations ALTER COLUMN budget_amount TYPE numeric
        USING round(budget_amount::numeric, 9);
    CREATE INDEX commitgate_operations_budget
        ON commitgate_operations (budget, principal, session, budget_spent_at)
        INCLUDE (state, budget_amount, expires_at) WHERE budget IS NOT NULL;

    DROP FUNCTION commitgate_claim_budgeted(text, text, text, text, text, text, text, text, text,
        double precision, double precision, double precision, text, boolean, double precision, boolean,
        boolean, boolean, text, text, double precision, double precision, double precision, text,
        double precision, text, double precision);

    CREATE FUNCTION commitgate_budget_lock(p_budget text, p_per text, p_principal text, p_session text)
    RETURNS void LANGUAGE sql AS $$
        SELECT pg_advisory_xact_lock(hashtextextended('commitgate.budget:' || p_budget
            || chr(31) || CASE WHEN p_per = 'all' THEN '' ELSE p_principal END
            || chr(31) || CASE WHEN p_per = 'session' THEN p_session ELSE '' END, 0));
    $$;

    CREATE FUNCTION commitgate_budget_spent(p_budget text, p_per text, p_principal text, p_session text,
        p_since double precision, p_now double precision)
    RETURNS numeric LANGUAGE sql STABLE AS $$
        SELECT coalesce(sum(o.budget_amount), 0) FROM commitgate_operations o
            WHERE o.budget = p_budget
                AND (p_per = 'all' OR o.principal = p_principal)
                AND (p_per <> 'session' OR o.session = p_session)
                AND o.budget_spent_at > p_since
                AND o.state IN ('PENDING', 'RUNNING', 'SUCCEEDED', 'UNKNOWN')
                AND (o.expires_at IS NULL OR o.expires_at > p_now);
    $$;

    CREATE FUNCTION commitgate_claim_budgeted(
        p_operation_id text, p_principal text, p_session text, p_step text, p_tool text,
        p_class text, p_fingerprint text, p_arguments text, p_owner text,
        p_lease double precision, p_retention double precision, p_now double precision,
        p_lease_lost text, p_duplicates boolean, p_window double precision, p_any_session boolean,
        p_reject boolean, p_confirmed boolean, p_budget text, p_per text, p_amount numeric,
        p_limit numeric, p_budget_window double precision, p_approval text,
        p_approval_expires_at double precision, p_over_approval text,
        p_over_approval_expires_at double precision, p_unit text
    ) RETURNS TABLE (kind text, op commitgate_operations, duplicate_of text, spent numeric)
    LANGUAGE plpgsql AS $$
    DECLARE
        e commitgate_operations;
        m commitgate_operations;
        v_spent numeric;
        v_may_spend boolean;
        v_over jsonb;
        c record;
    BEGIN
        SELECT o.* INTO e FROM commitgate_operations o
            WHERE o.principal = p_principal AND o.session = p_session AND o.step = p_step
                AND (o.expires_at IS NULL OR o.expires_at > p_now);
        IF NOT FOUND AND p_duplicates AND p_reject AND NOT p_confirmed THEN
            -- the same action already recorded is answered first, even when the budget has no room
            PERFORM pg_advisory_xact_lock(hashtextextended('commitgate.duplicates:' || p_principal
                || chr(31) || CASE WHEN p_any_session THEN '' ELSE p_session END
                || chr(31) || p_fingerprint, 0));
            SELECT o.* INTO m FROM commitgate_operations o
                WHERE o.principal = p_principal AND o.fingerprint = p_fingerprint
                    AND (p_any_session OR o.session = p_session)
                    AND o.created_at > p_now - p_window
                    AND o.state IN ('PENDING', 'RUNNING', 'SUCCEEDED', 'UNKNOWN', 'AWAITING_APPROVAL')
                    AND (o.expires_at IS NULL OR o.expires_at > p_now)
                    AND NOT (o.session = p_session AND o.step = p_step)
                ORDER BY o.created_at DESC LIMIT 1;
            IF m.operation_id IS NOT NULL THEN
                RETURN QUERY SELECT 'duplicate'::text, m, NULL::text, NULL::numeric;
                RETURN;
            END IF;
            SELECT o.* INTO e FROM commitgate_operations o  -- claimed while this one waited?
                WHERE o.principal = p_principal AND o.session = p_session AND o.step = p_step
                    AND (o.expires_at IS NULL OR o.expires_at > p_now);
        END IF;
        v_may_spend := e.operation_id IS NULL OR e.state = 'FAILED_RETRYABLE';  -- this call may execute
        IF v_may_spend THEN
            PERFORM commitgate_budget_lock(p_budget, p_per, p_principal, p_session);
            -- a concurrent call of the same key may have claimed it while this one waited
            SELECT o.* INTO e FROM commitgate_operations o
                WHERE o.principal = p_principal AND o.session = p_session AND o.step = p_step
                    AND (o.expires_at IS NULL OR o.expires_at > p_now);
            v_may_spend := NOT FOUND OR e.state = 'FAILED_RETRYABLE';
        END IF;
        IF v_may_spend THEN
            v_spent := commitgate_budget_spent(p_budget, p_per, p_principal, p_session,
                p_now - p_budget_window, p_now);
            IF v_spent + p_amount > p_limit AND p_over_approval IS NULL THEN
                RETURN QUERY SELECT 'over_budget'::text, NULL::commitgate_operations, NULL::text, v_spent;
                RETURN;
            ELSIF v_spent + p_amount > p_limit THEN  -- exceeded = "approval": an operator decides
                v_over := jsonb_strip_nulls(jsonb_build_object('name', p_budget, 'limit', trim_scale(p_limit),
                    'spent', trim_scale(v_spent), 'amount', trim_scale(p_amount), 'unit', p_unit));
                p_approval := (p_over_approval::jsonb || jsonb_build_object('over_budget', v_over))::text;
                p_approval_expires_at := p_over_approval_expires_at;
                IF e.operation_id IS NOT NULL THEN  -- a retryable operation taken again waits instead
                    UPDATE commitgate_operations AS o SET state = 'AWAITING_APPROVAL', lease_owner = NULL,
                            lease_expires_at = NULL, approval = p_approval,
                            approval_expires_at = p_approval_expires_at, updated_at = p_now,
                            completed_at = NULL, expires_at = NULL, budget_spent_at = NULL
                        WHERE o.operation_id = e.operation_id AND o.fence = e.fence
                            AND o.state = 'FAILED_RETRYABLE'
                        RETURNING o.* INTO e;
                    IF FOUND THEN
                        INSERT INTO commitgate_audit (operation_id, at, event, from_state, to_state, fence, actor)
                        VALUES (e.operation_id, p_now, 'approval_requested', 'FAILED_RETRYABLE',
                            'AWAITING_APPROVAL', e.fence, p_owner);
                        INSERT INTO commitgate_audit (operation_id, at, event, from_state, to_state, fence, actor,
                            detail)
                        VALUES (e.operation_id, p_now, 'budget_exceeded', NULL, 'AWAITING_APPROVAL', e.fence,
                            p_owner, v_over::text);
                        RETURN QUERY SELECT 'awaiting'::text, e, NULL::text, v_spent;
                        RETURN;
                    END IF;
                END IF;
            END IF;
        END IF;
        IF p_approval IS NOT NULL THEN
            SELECT * INTO c FROM commitgate_claim_awaiting(p_operation_id, p_principal, p_session, p_step,
                p_tool, p_class, p_fingerprint, p_arguments, p_owner, p_lease, p_retention, p_now,
                p_lease_lost, p_approval, p_approval_expires_at,
                CASE WHEN p_duplicates THEN p_window END, p_any_session, p_reject, p_confirmed);
        ELSIF p_duplicates THEN
            SELECT * INTO c FROM commitgate_claim_checked(p_operation_id, p_principal, p_session, p_step,
                p_tool, p_class, p_fingerprint, p_arguments, p_owner, p_lease, p_retention, p_now,
                p_lease_lost, p_window, p_any_session, p_reject, p_confirmed);
        ELSE
            SELECT x.kind, x.op, NULL::text AS duplicate_of INTO c FROM commitgate_claim(p_operation_id,
                p_principal, p_session, p_step, p_tool, p_class, p_fingerprint, p_arguments, p_owner,
                p_lease, p_retention, p_now, p_lease_lost) x;
        END IF;
        IF c.kind IN ('new', 'awaiting') THEN  -- it spends now if it runs now; a wait spends at its take
            UPDATE commitgate_operations AS o SET budget = p_budget, budget_amount = p_amount,
                    budget_spent_at = CASE WHEN c.kind = 'new' THEN p_now END
                WHERE o.operation_id = (c.op).operation_id
                RETURNING o.* INTO e;
            IF c.kind = 'awaiting' AND v_over IS NOT NULL THEN  -- waits because it is past its budget
                INSERT INTO commitgate_audit (operation_id, at, event, from_state, to_state, fence, actor, detail)
                VALUES (e.operation_id, p_now, 'budget_exceeded', NULL, 'AWAITING_APPROVAL', e.fence, p_owner,
                    v_over::text);
            END IF;
            RETURN QUERY SELECT c.kind, e, c.duplicate_of, v_spent;
            RETURN;
        END IF;
        RETURN QUERY SELECT c.kind, c.op, c.duplicate_of, v_spent;
    END $$;

    -- The take of an approved operation of a budgeted tool (PENDING -> RUNNING), its budget checked
    -- in the same transaction under the budget scope's lock. Not checked again: an overspend an
    -- operator approved, or a record that spent already. No room: 'over_budget', nothing taken.
    CREATE FUNCTION commitgate_take_budgeted(
        p_operation_id text, p_fence bigint, p_principal text, p_session text, p_event text,
        p_lease_owner text, p_lease_expires_at double precision, p_actor text, p_detail text,
        p_now double precision, p_budget text, p_per text, p_amount numeric, p_limit numeric,
        p_budget_window double precision
    ) RETURNS TABLE (kind text, op commitgate_operations, spent numeric)
    LANGUAGE plpgsql AS $$
    DECLARE
        r commitgate_operations;
        v_spent numeric;
    BEGIN
        PERFORM commitgate_budget_lock(p_budget, p_per, p_principal, p_session);
        SELECT o.* INTO r FROM commitgate_operations o
            WHERE o.operation_id = p_operation_id AND o.state = 'PENDING' AND o.fence = p_fence
            FOR UPDATE;
        IF NOT FOUND THEN
            RETURN;
        END IF;
        IF r.budget_spent_at IS NULL THEN
            IF r.approval IS NULL OR NOT (r.approval::jsonb ? 'over_budget') THEN
                v_spent := commitgate_budget_spent(p_budget, p_per, p_principal, p_session,
                    p_now - p_budget_window, p_now);
                IF v_spent + p_amount > p_limit THEN
                    RETURN QUERY SELECT 'over_budget'::text, r, v_spent;
                    RETURN;
                END IF;
            END IF;
            UPDATE commitgate_operations AS o SET budget = p_budget, budget_amount = p_amount,
                    budget_spent_at = p_now
                WHERE o.operation_id = p_operation_id;
        END IF;
        SELECT * INTO r FROM commitgate_update(p_operation_id, 'RUNNING', ARRAY['PENDING'], p_fence, p_event,
            NULL, NULL, NULL, true, p_lease_owner, p_lease_expires_at, false, p_actor, p_detail, p_now, NULL);
        RETURN QUERY SELECT 'taken'::text, r, v_spent;
    END $$;
    """,
    # 7: receipts (signed, chained per writer) and the outbox of notifications (ledger/evidence.py)
    POSTGRES_MIGRATION,
    # 8: the latest definition each upstream gave of its tools (server/ledger/tool_definitions.py)
    tool_definitions.POSTGRES_MIGRATION,
    # 9: when each attempt was taken and by whom, on this server's clock (never a replica's, whose
    # wall clocks differ and may step): a status check may conclude "not found" only once the
    # latest attempt can no longer be running. A trigger sets it at every take (a RUNNING row at a
    # new fence), whichever function takes. And a FAILED_FINAL that ran keeps counting against its
    # budget; one that never ran (a denied or expired approval, spent at its creation by migration
    # 6) gives its amount back.
    """
    ALTER TABLE commitgate_operations ADD COLUMN attempt_owner text;
    ALTER TABLE commitgate_operations ADD COLUMN attempt_started double precision;

    CREATE FUNCTION commitgate_attempt_started() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF NEW.state = 'RUNNING' AND (TG_OP = 'INSERT' OR NEW.fence IS DISTINCT FROM OLD.fence) THEN
            NEW.attempt_owner := NEW.lease_owner;
            NEW.attempt_started := extract(epoch FROM clock_timestamp());
        END IF;
        RETURN NEW;
    END $$;
    CREATE TRIGGER commitgate_attempt_started BEFORE INSERT OR UPDATE OF fence ON commitgate_operations
        FOR EACH ROW EXECUTE FUNCTION commitgate_attempt_started();

    UPDATE commitgate_operations SET budget_spent_at = NULL
        WHERE budget IS NOT NULL AND state = 'FAILED_FINAL' AND attempts = 0;
    CREATE OR REPLACE FUNCTION commitgate_budget_spent(p_budget text, p_per text, p_principal text,
        p_session text, p_since double precision, p_now double precision)
    RETURNS numeric LANGUAGE sql STABLE AS $$
        SELECT coalesce(sum(o.budget_amount), 0) FROM commitgate_operations o
            WHERE o.budget = p_budget
                AND (p_per = 'all' OR o.principal = p_principal)
                AND (p_per <> 'session' OR o.session = p_session)
                AND o.budget_spent_at > p_since
                AND o.state IN ('PENDING', 'RUNNING', 'SUCCEEDED', 'UNKNOWN', 'FAILED_FINAL')
                AND (o.expires_at IS NULL OR o.expires_at > p_now);
    $$;
    """,
]

SCHEMA_VERSION = len(MIGRATIONS)


# Connection loss, server errors, pool or statement timeouts: the ledger step did not happen
# (or cannot be known to have happened), so keyed tools fail closed.
_FAILURES = (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError)

_CLAIM = (
    "SELECT c.kind, (c.op).* FROM commitgate_claim($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13) c"
)
_CLAIM_CHECKED = (
    "SELECT c.kind, c.duplicate_of, (c.op).* FROM commitgate_claim_checked($1, $2, $3, $4, $5, $6, $7, $8,"
    " $9, $10, $11, $12, $13, $14, $15, $16, $17) c"
)
_UPDATE = (
    "SELECT * FROM commitgate_update($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16)"
)
_CLAIM_AWAITING = (
    "SELECT c.kind, c.duplicate_of, (c.op).* FROM commitgate_claim_awaiting($1, $2, $3, $4, $5, $6, $7, $8,"
    " $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19) c"
)
# durability = "claim": the outcome's transaction (this one statement's) commits without waiting for
# its WAL flush (synchronous_commit = off, local to it); PostgreSQL's WAL writer flushes it within
# about three times wal_writer_delay (200ms by default). A crash of the database server in that
# window loses the outcome, never the claim: the operation stays RUNNING, then UNKNOWN.
_UPDATE_LAZY = _UPDATE.replace("SELECT *", "SELECT *, set_config('synchronous_commit', 'off', true)")
_CLAIM_BUDGETED = (
    "SELECT c.kind, c.duplicate_of, c.spent, (c.op).* FROM commitgate_claim_budgeted($1, $2, $3, $4, $5, $6,"
    " $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21, $22, $23, $24, $25, $26, $27,"
    " $28) c"
)
_TAKE_BUDGETED = (
    "SELECT t.kind, t.spent, (t.op).* FROM commitgate_take_budgeted($1, $2, $3, $4, $5, $6, $7, $8, $9, $10,"
    " $11, $12, $13, $14, $15) t"
)

# RUNNING -> UNKNOWN for the rows `{which}` selects; each row moves once even with several sweepers.
_TO_UNKNOWN = """
WITH moved AS (
    UPDATE commitgate_operations AS o SET state = 'UNKNOWN', lease_owner = NULL, lease_expires_at = NULL,
        updated_at = $1, error = $2
    WHERE o.state = 'RUNNING' AND {which}
    RETURNING o.*
), audited AS (
    INSERT INTO commitgate_audit (operation_id, at, event, from_state, to_state, fence)
    SELECT operation_id, $1, 'lease_expired', 'RUNNING', 'UNKNOWN', fence FROM moved
)
SELECT * FROM moved
"""
_EXPIRE_LEASES = _TO_UNKNOWN.format(
    which="o.operation_id IN (SELECT operation_id FROM commitgate_operations WHERE state = 'RUNNING'"
    " AND (lease_expires_at <= $1 OR lease_owner = ANY ($3::text[])) FOR UPDATE SKIP LOCKED)"
    " AND (o.lease_expires_at <= $1 OR o.lease_owner = ANY ($3::text[]))"
)
_EXPIRE_DEAD_OWNER = _TO_UNKNOWN.format(which="o.operation_id = $3 AND o.fence = $4 AND o.lease_owner = $5")

_PURGE_BATCH = """
WITH doomed AS (
    SELECT operation_id FROM commitgate_operations
    WHERE expires_at <= $1 AND state <> 'UNKNOWN'
    LIMIT $2 FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM commitgate_operations o USING doomed d
    WHERE o.operation_id = d.operation_id AND o.expires_at <= $1 AND o.state <> 'UNKNOWN'
    RETURNING o.operation_id
), gone_audit AS (
    DELETE FROM commitgate_audit a USING gone g WHERE a.operation_id = g.operation_id
)
SELECT count(*) FROM gone
"""

_SELECT = "SELECT * FROM commitgate_operations"

MIGRATION_LOCK = "SELECT pg_advisory_xact_lock(hashtextextended('commitgate.migrate:' || coalesce(current_schema(), ''), 0))"
_VERSION_TABLE = """
CREATE TABLE IF NOT EXISTS commitgate_schema_version (
    version    integer PRIMARY KEY,
    applied_at timestamptz NOT NULL DEFAULT now()
)
"""


def _decode(row: asyncpg.Record) -> Operation:
    return Operation(
        operation_id=row["operation_id"],
        principal=row["principal"],
        session=row["session"],
        step=row["step"],
        tool=row["tool"],
        idempotency_class=IdempotencyClass(row["idempotency_class"]),
        fingerprint=row["fingerprint"],
        state=State(row["state"]),
        attempts=row["attempts"],
        fence=row["fence"],
        arguments=json.loads(row["arguments"]),
        lease_owner=row["lease_owner"],
        lease_expires_at=row["lease_expires_at"],
        result=ToolResult.from_json(row["result"]) if row["result"] else None,
        error=ErrorRecord.from_stored(json.loads(row["error"])) if row["error"] else None,
        reconciliation=(
            ReconciliationNote.from_stored(json.loads(row["reconciliation"]))
            if row["reconciliation"]
            else None
        ),
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        completed_at=row["completed_at"],
        expires_at=row["expires_at"],
        retention=row["retention"],
        approval=ApprovalRecord.from_stored(json.loads(row["approval"])) if row["approval"] else None,
        arguments_json=row["arguments"],
    )


def _dump(value: Any) -> str | None:
    return None if value is None else json.dumps(value, separators=(",", ":"), default=str)


def _dump_record(record: ErrorRecord | ReconciliationNote | ApprovalRecord | None) -> str | None:
    """An operation's error, reconciliation or approval as the ledger stores it (`_decode` reads it back)."""
    return None if record is None else _dump(record.stored())


def redact(url: str) -> str:
    """The URL without its password, fit for messages and logs."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


async def _apply_migrations(conn: asyncpg.Connection) -> int:
    """Bring the schema up to date in one transaction; returns how many migrations this call applied."""
    async with conn.transaction():
        # The lock is held to commit: concurrent starters queue here.
        await conn.execute(f"{MIGRATION_LOCK};\n{_VERSION_TABLE}")
        current = int(await conn.fetchval("SELECT coalesce(max(version), 0) FROM commitgate_schema_version"))
        if current > SCHEMA_VERSION:
            raise LedgerUnavailable(
                f"ledger schema version {current} is newer than this commitgate ({SCHEMA_VERSION}); upgrade commitgate"
            )
        if current < SCHEMA_VERSION:
            await conn.execute(_pending_migrations(current))
        return SCHEMA_VERSION - current


def _pending_migrations(current: int) -> str:
    """The migrations after version `current`, each followed by its version row, as one script:
    a new ledger is made in one round trip, not two per migration (a remote database's latency,
    or a busy machine's wait for the next turn, is paid once)."""
    return "\n".join(
        f"{MIGRATIONS[version - 1]}\n;\nINSERT INTO commitgate_schema_version (version) VALUES ({version});"
        for version in range(current + 1, SCHEMA_VERSION + 1)
    )


async def _schema_version(conn: asyncpg.Connection) -> int:
    exists = await conn.fetchval("SELECT to_regclass('commitgate_schema_version') IS NOT NULL")
    if not exists:
        return 0
    return int(await conn.fetchval("SELECT coalesce(max(version), 0) FROM commitgate_schema_version"))


async def migrate(url: str, *, timeout: float = 60.0) -> int:
    """Apply pending migrations at `url`; returns how many this call applied (0: already current).

    Safe to run from several replicas at once: the advisory lock makes all but
    one wait, and they then find nothing left to do.
    """
    try:
        conn = await asyncpg.connect(url, timeout=timeout)
    except _FAILURES as exc:
        raise LedgerUnavailable(f"cannot connect to the ledger {redact(url)}: {exc}") from exc
    try:
        async with asyncio.timeout(timeout):
            return await _apply_migrations(conn)
    except _FAILURES as exc:
        raise LedgerUnavailable(f"ledger migration failed on {redact(url)}: {exc}") from exc
    finally:
        await conn.close()


async def _keep_session(conn: asyncpg.Connection) -> None:
    """Pool release hook. The ledger never changes session state (no SET, LISTEN or session locks),
    so the default reset (`RESET ALL; UNLISTEN *; ...`) would only cost a round trip per step; an
    open transaction is still rolled back by asyncpg itself."""


def _claim_arguments(request: ClaimRequest, now: float) -> tuple[Any, ...]:
    """The parameters every claim function starts with, a fresh operation id first."""
    return (
        "op_" + uuid.uuid4().hex,
        request.principal,
        request.session,
        request.step,
        request.tool,
        request.idempotency_class.value,
        request.fingerprint,
        request.arguments_json,
        request.owner,
        request.lease_seconds,
        request.retention_seconds,
        now,
        _dump_record(LEASE_LOST),
    )


class PostgresLedger:
    """A ledger in PostgreSQL behind an asyncpg pool; see the module docstring."""

    def __init__(self, pool: asyncpg.Pool, url: str, timeout: float) -> None:
        self._pool = pool
        self.url = redact(url)
        self._timeout = timeout
        self._host_prefix = socket.gethostname() + ":"
        self.lazy_outcomes = False  # durability "claim": outcomes commit without waiting for the WAL flush
        self.timer: StepTimer | None = None  # see `timed`
        self._evidence: Evidence | None = None  # receipts and events added to every write

    @classmethod
    async def open(
        cls,
        url: str,
        *,
        min_size: int = 2,
        max_size: int = 16,
        timeout: float = 30.0,
        auto_migrate: bool = True,
        durability: str = "full",
    ) -> PostgresLedger:
        """Connect a pool and bring the schema up to date (or, with `auto_migrate=False`, require it).

        `timeout` bounds every ledger step, waiting for a pooled connection included.
        """
        try:
            pool = await asyncpg.create_pool(
                url,
                min_size=min_size,
                max_size=max_size,
                timeout=timeout,
                reset=_keep_session,
            )
        except _FAILURES as exc:
            raise LedgerUnavailable(f"cannot connect to the ledger {redact(url)}: {exc}") from exc
        ledger = cls(pool, url, timeout)
        ledger.lazy_outcomes = durability == "claim"
        try:
            await ledger._run(_apply_migrations if auto_migrate else ledger._require_current)
        except BaseException:
            await pool.close()
            raise
        return ledger

    async def _require_current(self, conn: asyncpg.Connection) -> int:
        version = await _schema_version(conn)
        if version == 0:
            raise LedgerUnavailable(
                "no commitgate ledger in this database: check the URL, or create one with"
                " `commitgate ops migrate`"
            )
        if version != SCHEMA_VERSION:
            raise LedgerUnavailable(
                f"ledger schema is at version {version}, this commitgate needs {SCHEMA_VERSION}:"
                " run `commitgate ops migrate`"
            )
        return 0

    async def _run(self, step: Callable[[asyncpg.Connection], Awaitable[T]]) -> T:
        """One ledger step on a pooled connection; any database failure becomes LedgerUnavailable."""
        try:
            async with asyncio.timeout(self._timeout), self._pool.acquire() as conn:
                return await step(conn)
        except _FAILURES as exc:
            raise LedgerUnavailable(f"ledger {self.url}: {type(exc).__name__}: {exc}") from exc

    async def _fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        rows: list[asyncpg.Record] = await self._run(lambda conn: conn.fetch(sql, *args))
        return rows

    async def _change(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        """A write step: with receipts or notifications, in a transaction that also writes them."""
        if self._evidence is None:
            return await self._fetch(sql, *args)
        return await self._run(lambda conn: self._sealed(conn, lambda: conn.fetch(sql, *args)))

    async def _sealed(
        self, conn: asyncpg.Connection, step: Callable[[], Awaitable[list[asyncpg.Record]]]
    ) -> list[asyncpg.Record]:
        sealer = self._evidence
        assert sealer is not None
        lane = sealer.take_lane()
        async with conn.transaction():
            rows = await step()
            await evidence.seal_postgres(conn, sealer, lane, [row["operation_id"] for row in rows])
        sealer.give_back(lane)  # not reached when the transaction failed: that lane's chain ends
        return rows

    # --- the hot path ---------------------------------------------------------------------

    @timed
    async def claim(self, request: ClaimRequest, now: float) -> Claim:
        if request.budget is not None:  # the budget function also records a wait for approval
            return await self._claim_budgeted(request, now)
        if request.approval is not None:
            return await self._claim_awaiting(request, now)
        check = request.duplicates
        duplicates = (
            () if check is None else (check.window_seconds, check.any_session, check.reject, check.confirmed)
        )
        rows = await self._change(
            _CLAIM if check is None else _CLAIM_CHECKED, *_claim_arguments(request, now), *duplicates
        )
        return await self._answer(rows, now)

    async def _claim_awaiting(self, request: ClaimRequest, now: float) -> Claim:
        approval, check = request.approval, request.duplicates
        assert approval is not None
        duplicates = (
            (None, False, False, False)
            if check is None
            else (check.window_seconds, check.any_session, check.reject, check.confirmed)
        )
        rows = await self._change(
            _CLAIM_AWAITING,
            *_claim_arguments(request, now),
            _dump_record(approval),
            approval.expires_at,
            *duplicates,
        )
        return await self._answer(rows, now)

    async def _claim_budgeted(self, request: ClaimRequest, now: float) -> Claim:
        check, budget, approval = request.duplicates, request.budget, request.approval
        assert budget is not None
        # Past its budget with `exceeded = "approval"`, the call waits for an operator with the tool's
        # own approval record if it needs one anyway, else the budget's; the function adds `over_budget`.
        over = (
            dataclasses.replace(approval or budget.approval, deciders=budget.approval.deciders)
            if budget.approval is not None
            else None
        )
        duplicates = (
            (False, 0.0, False, False, False)
            if check is None
            else (True, check.window_seconds, check.any_session, check.reject, check.confirmed)
        )
        rows = await self._change(
            _CLAIM_BUDGETED,
            *_claim_arguments(request, now),
            *duplicates,
            budget.name,
            budget.per,
            budget.amount,
            budget.limit,
            budget.window_seconds,
            _dump_record(approval),
            approval.expires_at if approval is not None else None,
            _dump_record(over),
            over.expires_at if over is not None else None,
            budget.unit,
        )
        if rows[0]["kind"] == "over_budget":
            raise OverBudget(rows[0]["spent"])
        return await self._answer(rows, now)

    async def _answer(self, rows: list[asyncpg.Record], now: float) -> Claim:
        """The claim a claim function's row says; a key held by a dead owner of this host is expired."""
        row = rows[0]
        kind, op = ClaimKind(row["kind"]), _decode(row)
        if kind is ClaimKind.EXISTING and op.state is State.RUNNING and owner_known_dead(op.lease_owner):
            op = await self._expire_dead_owner(op, now)
        return Claim(kind, op, row.get("duplicate_of"))

    async def _expire_dead_owner(self, op: Operation, now: float) -> Operation:
        rows = await self._change(
            _EXPIRE_DEAD_OWNER, now, _dump_record(LEASE_LOST), op.operation_id, op.fence, op.lease_owner
        )
        if rows:
            return _decode(rows[0])
        return await self.get_by_id(None, op.operation_id) or op

    @timed
    async def update(
        self, operation_id: str, change: Transition, now: float, *, current: Operation | None = None
    ) -> Operation | None:
        if change.budget is not None:  # the budget's scope is the operation's principal and session
            known = current or await self.get_by_id(None, operation_id)
            return (
                await self._take_budgeted(operation_id, change, change.budget, known, now) if known else None
            )
        lease = change.lease  # one statement checks and writes: `current` would save nothing
        lazy = self.lazy_outcomes and is_outcome(change)
        rows = await self._change(
            _UPDATE_LAZY if lazy else _UPDATE,
            operation_id,
            change.to_state.value,
            sorted(state.value for state in change.expect_states),
            change.expect_fence,
            change.event,
            change.result.to_json() if change.result is not None else None,
            _dump_record(change.error),
            _dump_record(change.reconciliation),
            lease is not None,
            lease.owner if lease is not None else None,
            lease.expires_at if lease is not None else None,
            change.to_state.terminal,
            recorded_actor(change.actor),
            _dump(change.detail),
            now,
            _dump_record(change.approval),
        )
        return _decode(rows[0]) if rows else None

    async def _take_budgeted(
        self, operation_id: str, change: Transition, budget: BudgetCheck, current: Operation, now: float
    ) -> Operation | None:
        """The take of an approved operation with its budget checked in the same transaction."""
        lease = change.lease
        assert lease is not None and change.expect_fence is not None
        rows = await self._change(
            _TAKE_BUDGETED,
            operation_id,
            change.expect_fence,
            current.principal,
            current.session,
            change.event,
            lease.owner,
            lease.expires_at,
            recorded_actor(change.actor),
            _dump(change.detail),
            now,
            budget.name,
            budget.per,
            budget.amount,
            budget.limit,
            budget.window_seconds,
        )
        if not rows:
            return None
        if rows[0]["kind"] == "over_budget":
            raise OverBudget(rows[0]["spent"])
        return _decode(rows[0])

    @timed
    async def attempt_start(self, operation_id: str, fence: int) -> AttemptStart | None:
        rows = await self._fetch(
            "SELECT attempt_owner, extract(epoch FROM clock_timestamp()) - attempt_started"
            " FROM commitgate_operations WHERE operation_id = $1 AND fence = $2 AND attempt_started IS NOT NULL",
            operation_id,
            fence,
        )
        if not rows:
            return None
        # This server's clock stepped back: the attempt counts as just taken (until the clock catches up).
        return AttemptStart(rows[0][0], max(0.0, float(rows[0][1])))

    @timed
    async def renew_lease(self, operation_id: str, fence: int, lease: Lease) -> bool:
        status = await self._run(
            lambda conn: conn.execute(
                "UPDATE commitgate_operations SET lease_owner = $1, lease_expires_at = $2"
                " WHERE operation_id = $3 AND fence = $4 AND state = 'RUNNING'",
                lease.owner,
                lease.expires_at,
                operation_id,
                fence,
            )
        )
        return bool(status == "UPDATE 1")

    # --- reads ------------------------------------------------------------------------------

    @timed
    async def get(self, principal: str, session: str, step: str) -> Operation | None:
        rows = await self._fetch(
            f"{_SELECT} WHERE principal = $1 AND session = $2 AND step = $3", principal, session, step
        )
        return _decode(rows[0]) if rows else None

    @timed
    async def get_by_id(self, principal: str | None, operation_id: str) -> Operation | None:
        rows = await self._fetch(f"{_SELECT} WHERE operation_id = $1", operation_id)
        if not rows:
            return None
        op = _decode(rows[0])
        return op if principal is None or op.principal == principal else None

    @timed
    async def find(self, where: OperationFilter) -> list[Operation]:
        terms = filter_terms(where)
        clauses = [condition.format(f"${n}") for n, (condition, _) in enumerate(terms, 1)]
        params = [value for _, value in terms] + [where.limit]
        sql = _SELECT + (" WHERE " + " AND ".join(clauses) if clauses else "")
        sql += f" ORDER BY created_at DESC, seq DESC LIMIT ${len(params)}"
        return [_decode(row) for row in await self._fetch(sql, *params)]

    @timed
    async def history(self, operation_id: str) -> list[AuditEntry]:
        rows = await self._fetch(
            "SELECT at, event, from_state, to_state, fence, actor, detail FROM commitgate_audit"
            " WHERE operation_id = $1 ORDER BY id",
            operation_id,
        )
        return [
            AuditEntry(
                r["at"],
                r["event"],
                r["from_state"],
                r["to_state"],
                r["fence"],
                r["actor"],
                json.loads(r["detail"]) if r["detail"] else None,
            )
            for r in rows
        ]

    # --- sweeps: safe with several replicas --------------------------------------------------

    @timed
    async def expire_leases(self, now: float) -> list[Operation]:
        async def step(conn: asyncpg.Connection) -> list[asyncpg.Record]:
            owners = await conn.fetch(
                "SELECT DISTINCT lease_owner FROM commitgate_operations"
                " WHERE state = 'RUNNING' AND lease_expires_at > $1 AND starts_with(lease_owner, $2)",
                now,
                self._host_prefix,
            )
            dead = [row[0] for row in owners if owner_known_dead(row[0])]
            if self._evidence is not None:
                return await self._sealed(
                    conn, lambda: conn.fetch(_EXPIRE_LEASES, now, _dump_record(LEASE_LOST), dead)
                )
            return list(await conn.fetch(_EXPIRE_LEASES, now, _dump_record(LEASE_LOST), dead))

        return [_decode(row) for row in await self._run(step)]

    @timed
    async def purge(self, now: float, *, batch: int = 1000) -> int:
        """Delete in batches of `batch` rows, each its own short transaction, skipping rows in use."""
        total = 0
        while True:
            gone = await self._run(lambda conn: conn.fetchval(_PURGE_BATCH, now, batch))
            total += int(gone)
            if gone < batch:
                return total

    @timed
    async def counts(self) -> Counts:
        states = {state.value: 0 for state in State}
        for state, n in await self._fetch("SELECT state, count(*) FROM commitgate_operations GROUP BY state"):
            states[state] = n
        events = dict(await self._fetch("SELECT event, count(*) FROM commitgate_audit GROUP BY event"))
        return Counts(states, events)

    @timed
    async def budget_spent(self, budget: str, per: str, since: float, now: float) -> list[Spent]:
        columns = {
            "all": "NULL::text, NULL::text",
            "principal": "principal, NULL::text",
            "session": "principal, session",
        }[per]
        rows = await self._fetch(
            f"SELECT {columns}, sum(budget_amount), count(*) FROM commitgate_operations"
            " WHERE budget = $1 AND budget_spent_at > $2 AND state = ANY ($3::text[])"
            " AND (expires_at IS NULL OR expires_at > $4) GROUP BY 1, 2 ORDER BY 3 DESC",
            budget,
            since,
            [state.value for state in BUDGET_STATES],
            now,
        )
        return [Spent(r[0], r[1], r[2], int(r[3])) for r in rows]

    @timed
    async def budget_spending(
        self,
        budget: str,
        principal: str | None,
        session: str | None,
        since: float,
        now: float,
        span_seconds: float,
    ) -> list[SpentIn]:
        rows = await self._fetch(
            "SELECT floor(budget_spent_at / $1)::bigint, sum(budget_amount), count(*) FROM commitgate_operations"
            " WHERE budget = $2 AND budget_spent_at > $3 AND state = ANY ($4::text[])"
            " AND (expires_at IS NULL OR expires_at > $5)"
            " AND ($6::text IS NULL OR principal = $6) AND ($7::text IS NULL OR session = $7)"
            " GROUP BY 1 ORDER BY 1",
            span_seconds,
            budget,
            since,
            [state.value for state in BUDGET_STATES],
            now,
            principal,
            session if principal is not None else None,
        )
        return [SpentIn(r[0] * span_seconds, r[1], int(r[2])) for r in rows]

    @timed
    async def tool_definitions(self, upstreams: Sequence[str]) -> dict[str, Definitions]:
        """The latest definitions of `upstreams`' tools (server/ledger/tool_definitions.py)."""
        sql = select_sql("commitgate_tool_definitions", len(upstreams), numbered=True)
        return grouped(await self._fetch(sql, *upstreams)) if upstreams else {}

    async def record_tool_definitions(self, upstream: str, tools: Definitions, now: float) -> None:
        await self._run(lambda conn: postgres_record(conn, upstream, tools, now))

    async def check_writable(self) -> None:
        # Rejected on a standby or in a read-only transaction, yet writes nothing.
        await self._run(
            lambda conn: conn.execute("UPDATE commitgate_schema_version SET version = version WHERE false")
        )

    # --- receipts and the outbox (ledger/evidence.py) -------------------------------------------

    def attach(self, sealer: Evidence) -> None:
        self._evidence = sealer if sealer.active else None

    async def outbox_take(self, owner: str, now: float, lease: float, limit: int) -> list[OutboxItem]:
        return await self._run(lambda conn: evidence.postgres_take(conn, owner, now, lease, limit))

    async def outbox_settle(self, item: OutboxItem, owner: str, settled: Settled) -> bool:
        return await self._run(lambda conn: evidence.postgres_settle(conn, item, owner, settled))

    async def undelivered(self) -> list[OutboxItem]:
        return [
            evidence.outbox_item(tuple(r))
            for r in await self._fetch(evidence.undelivered_sql("commitgate_outbox"))
        ]

    async def receipts(self, since: float | None = None) -> list[dict[str, Any]]:
        sql = evidence.receipts_sql("commitgate_receipts", since is not None, "$1")
        rows = await self._fetch(sql, *((at_text(since),) if since is not None else ()))
        return [evidence.receipt_of(tuple(row)) for row in rows]

    async def stored_digests(self) -> dict[str, tuple[str | None, str | None]]:
        rows = await self._fetch("SELECT operation_id, arguments, result FROM commitgate_operations")
        return {row[0]: (digest(row[1]), digest(row[2])) for row in rows}

    async def schema_version(self) -> int:
        return await self._run(_schema_version)

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self._pool.close(), self._timeout)
        except TimeoutError:
            self._pool.terminate()
