"""`commitgate sandbox`: a small Stripe-like payments API on loopback, with its own SQLite store.

It is the downstream the http source is tested, demonstrated and benchmarked against:

    POST /v1/charges    {"amount_cents": 500, "card": "4242424242424242", "currency": "usd", "description": "tea"}
    POST /v1/refunds    {"charge": "ch_...", "amount_cents": 200}
    POST /v1/charges/{id}/refunds    {"amount_cents": 200}      (the same, the charge in the path)
    GET  /v1/charges/{id}
    GET  /v1/charges?idempotency_key=K     (404 when no charge carries that key)
    GET  /v1/refunds?idempotency_key=K     (404 when none)

Like Stripe it honours `Idempotency-Key` on POST: the same key with the same body answers the first
response again (header `Idempotent-Replayed: true`), the same key with another body answers 409.
`--no-idempotency` turns that off (every POST acts; the key is still stored for lookups), to show
what the gateway protects against. Card `4000000000000002` is declined (402).

Faults, set by flags or at run time with `POST /_sandbox/config` (JSON of the same names):
  lose_response P  after committing a POST, lose its answer: drop the connection (`lose_mode = "drop"`)
                   or hold it `hang` seconds, past the client's timeout (`lose_mode = "hang"`)
  latency S        added before every /v1 request
  fail_5xx P       answer 500 before doing anything
  rate_limit P     answer 429 with `Retry-After: retry_after` before doing anything
  fault_budget N   inject at most N faults in all, then behave (deterministic tests)
Every /v1 request is logged in the store's `requests` table (time, method, path, key, status, fault).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import random
import secrets
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

DEFAULT_PORT = 8790
DECLINED_CARD = "4000000000000002"
READY_PREFIX = "commitgate sandbox: listening on "

SCHEMA = """
CREATE TABLE IF NOT EXISTS charges (
    id TEXT PRIMARY KEY, amount_cents INTEGER NOT NULL, currency TEXT NOT NULL, card_last4 TEXT NOT NULL,
    description TEXT, refunded_cents INTEGER NOT NULL DEFAULT 0, idempotency_key TEXT, created REAL NOT NULL);
CREATE INDEX IF NOT EXISTS charges_by_key ON charges (idempotency_key);
CREATE TABLE IF NOT EXISTS refunds (
    id TEXT PRIMARY KEY, charge TEXT NOT NULL, amount_cents INTEGER NOT NULL, idempotency_key TEXT,
    created REAL NOT NULL);
CREATE INDEX IF NOT EXISTS refunds_by_key ON refunds (idempotency_key);
CREATE TABLE IF NOT EXISTS idempotency (
    key TEXT PRIMARY KEY, endpoint TEXT NOT NULL, request_hash TEXT NOT NULL, status INTEGER NOT NULL,
    body TEXT NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS requests (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, method TEXT NOT NULL, path TEXT NOT NULL,
    idempotency_key TEXT, status INTEGER, fault TEXT);
"""


@dataclass
class Settings:
    idempotency: bool = True
    lose_response: float = 0.0
    lose_mode: Literal["drop", "hang"] = "drop"
    hang: float = 30.0
    latency: float = 0.0
    fail_5xx: float = 0.0
    rate_limit: float = 0.0
    retry_after: float = 1.0
    fault_budget: int | None = None
    seed: int | None = None
    token: str | None = field(default=None, repr=False)  # Bearer token required on /v1 when set

    def update(self, changes: dict[str, Any], *, reset: bool = False) -> None:
        """Apply `changes`; with `reset`, every other setting (but the token) returns to its default."""
        names = {f.name for f in fields(self)} - {"token"}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise ValueError(f"unknown settings: {', '.join(unknown)}")
        base = {**asdict(Settings()), "token": self.token} if reset else {}
        for name, value in {**base, **changes}.items():
            setattr(self, name, value)

    def public(self) -> dict[str, Any]:
        view = asdict(self)
        view["token"] = "set" if self.token else None
        return view


class ApiError(Exception):
    def __init__(self, status: int, kind: str, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.code = status, kind, message, code

    def body(self) -> dict[str, Any]:
        error = {"type": self.kind, "message": self.message}
        if self.code:
            error["code"] = self.code
        return {"error": error}


# --- the store -----------------------------------------------------------------------------------


class Store:
    """One SQLite file, used from the event loop only: each request's reads and writes run without an
    await in between, so the idempotency check and the charge it guards commit together."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript(SCHEMA)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def one(self, sql: str, *args: Any) -> dict[str, Any] | None:
        row = self.db.execute(sql, args).fetchone()
        return dict(row) if row is not None else None

    def log(self, method: str, path: str, key: str | None, status: int | None, fault: str | None) -> None:
        self.db.execute(
            "INSERT INTO requests (at, method, path, idempotency_key, status, fault) VALUES (?, ?, ?, ?, ?, ?)",
            (time.time(), method, path, key, status, fault),
        )


def _charge_view(row: dict[str, Any]) -> dict[str, Any]:
    return {"object": "charge", "status": "succeeded", **row}


def _refund_view(row: dict[str, Any]) -> dict[str, Any]:
    return {"object": "refund", "status": "succeeded", **row}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(8)}"


def _positive_int(body: dict[str, Any], name: str) -> int:
    value = body.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ApiError(
            400, "invalid_request_error", f"{name} must be a positive integer", "parameter_invalid"
        )
    return value


def create_charge(store: Store, body: dict[str, Any], key: str | None) -> dict[str, Any]:
    amount = _positive_int(body, "amount_cents")
    card = body.get("card")
    if not isinstance(card, str) or not card.isdigit() or not 4 <= len(card) <= 19:
        raise ApiError(400, "invalid_request_error", "card must be 4-19 digits", "parameter_invalid")
    currency = body.get("currency", "usd")
    if not isinstance(currency, str) or len(currency) != 3:
        raise ApiError(400, "invalid_request_error", "currency must be a 3-letter code", "parameter_invalid")
    description = body.get("description")
    if card == DECLINED_CARD:
        raise ApiError(402, "card_error", "Your card was declined.", "card_declined")
    row = {
        "id": _new_id("ch"),
        "amount_cents": amount,
        "currency": currency.lower(),
        "card_last4": card[-4:],
        "description": description if isinstance(description, str) else None,
        "refunded_cents": 0,
        "idempotency_key": key,
        "created": time.time(),
    }
    store.db.execute(
        "INSERT INTO charges (id, amount_cents, currency, card_last4, description, refunded_cents, "
        "idempotency_key, created) VALUES (:id, :amount_cents, :currency, :card_last4, :description, "
        ":refunded_cents, :idempotency_key, :created)",
        row,
    )
    return _charge_view(row)


def create_refund(store: Store, body: dict[str, Any], key: str | None) -> dict[str, Any]:
    charge_id = body.get("charge")
    amount = _positive_int(body, "amount_cents")
    if not isinstance(charge_id, str):
        raise ApiError(400, "invalid_request_error", "charge must be a charge id", "parameter_invalid")
    charge = store.one("SELECT * FROM charges WHERE id = ?", charge_id)
    if charge is None:
        raise ApiError(404, "invalid_request_error", f"No such charge: {charge_id}", "resource_missing")
    left = charge["amount_cents"] - charge["refunded_cents"]
    if amount > left:
        raise ApiError(
            400, "invalid_request_error", f"only {left} cents are left to refund", "amount_too_large"
        )
    row = {"id": _new_id("re"), "charge": charge_id, "amount_cents": amount, "idempotency_key": key}
    row["created"] = time.time()
    store.db.execute(
        "INSERT INTO refunds (id, charge, amount_cents, idempotency_key, created) "
        "VALUES (:id, :charge, :amount_cents, :idempotency_key, :created)",
        row,
    )
    store.db.execute(
        "UPDATE charges SET refunded_cents = refunded_cents + ? WHERE id = ?", (amount, charge_id)
    )
    return _refund_view(row)


CREATORS = {"/v1/charges": create_charge, "/v1/refunds": create_refund}


# --- faults --------------------------------------------------------------------------------------


@dataclass
class Faults:
    settings: Settings
    rng: random.Random
    injected: int = 0

    def roll(self, probability: float) -> bool:
        budget = self.settings.fault_budget
        if probability <= 0 or (budget is not None and self.injected >= budget):
            return False
        if self.rng.random() < probability:
            self.injected += 1
            return True
        return False


class LostResponse(Response):
    """The answer never arrives: the connection is dropped (or held past the client's patience)."""

    def __init__(self, mode: str, hang: float) -> None:
        super().__init__(status_code=200)
        self.mode, self.hang = mode, hang

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.mode == "hang":
            await asyncio.sleep(self.hang)
            return await Response(status_code=504)(scope, receive, send)
        transport = getattr(getattr(receive, "__self__", None), "transport", None)  # uvicorn's cycle
        if transport is not None:
            transport.abort()
            await asyncio.sleep(0.01)  # let the server notice the disconnect before we return
            return None
        # Elsewhere: promise a body and stop half-way, which the server turns into a closed connection.
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"64")]})
        await send({"type": "http.response.body", "body": b"{", "more_body": True})
        return None


# --- the API -------------------------------------------------------------------------------------


def _json(status: int, body: dict[str, Any], **headers: str) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers=headers or None)


def _request_hash(endpoint: str, body: dict[str, Any]) -> str:
    canonical = json.dumps({"endpoint": endpoint, "body": body}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


class Api:
    def __init__(self, store: Store, settings: Settings) -> None:
        self.store, self.settings = store, settings
        self.faults = Faults(settings, random.Random(settings.seed))

    async def v1(self, request: Request) -> Response:
        key = request.headers.get("idempotency-key")
        fault: str | None = None
        try:
            response, fault = await self._v1(request, key)
        except ApiError as exc:
            response = _json(exc.status, exc.body())
        self.store.log(request.method, request.url.path, key, response.status_code, fault)
        return response

    async def _v1(self, request: Request, key: str | None) -> tuple[Response, str | None]:
        settings = self.settings
        if settings.token and request.headers.get("authorization") != f"Bearer {settings.token}":
            raise ApiError(401, "authentication_error", "Invalid API key provided.")
        if settings.latency > 0:
            await asyncio.sleep(settings.latency)
        if self.faults.roll(settings.rate_limit):
            retry_after = f"{settings.retry_after:g}"
            body = {"error": {"type": "rate_limit_error", "message": "Too many requests."}}
            return _json(429, body, **{"Retry-After": retry_after}), "rate_limit"
        if self.faults.roll(settings.fail_5xx):
            return _json(
                500, {"error": {"type": "api_error", "message": "Something went wrong."}}
            ), "fail_5xx"
        if request.method == "GET":
            return self._read(request), None
        endpoint, body = request.url.path, await _body(request)
        if "id" in request.path_params:  # POST /v1/charges/{id}/refunds: the charge in the path
            endpoint, body = "/v1/refunds", {**body, "charge": request.path_params["id"]}
        status, body, replayed = self._write(endpoint, body, key)
        if 200 <= status < 300 and self.faults.roll(settings.lose_response):
            return LostResponse(settings.lose_mode, settings.hang), "lose_response"
        headers = {"Idempotent-Replayed": "true"} if replayed else {}
        return _json(status, body, **headers), None

    def _write(
        self, endpoint: str, body: dict[str, Any], key: str | None
    ) -> tuple[int, dict[str, Any], bool]:
        """Act once per key: the stored answer, a 409 for a reused key, or a new effect recorded with it."""
        digest = _request_hash(endpoint, body)
        with self.store.transaction() as db:
            if key and self.settings.idempotency:
                seen = self.store.one("SELECT * FROM idempotency WHERE key = ?", key)
                if seen is not None:
                    if seen["endpoint"] != endpoint or seen["request_hash"] != digest:
                        raise ApiError(
                            409,
                            "idempotency_error",
                            "Keys for idempotent requests can only be used with the same parameters "
                            "they were first used with.",
                        )
                    return int(seen["status"]), json.loads(seen["body"]), True
            try:
                status, answer = 200, CREATORS[endpoint](self.store, body, key)
            except ApiError as exc:
                if exc.status == 400 and exc.code == "parameter_invalid":
                    raise  # a malformed request is not an outcome worth remembering
                status, answer = exc.status, exc.body()
            if key and self.settings.idempotency:
                db.execute(
                    "INSERT INTO idempotency (key, endpoint, request_hash, status, body, created) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    (key, endpoint, digest, status, json.dumps(answer), time.time()),
                )
        return status, answer, False

    def _read(self, request: Request) -> Response:
        path = request.url.path
        table, view = (
            ("charges", _charge_view) if path.startswith("/v1/charges") else ("refunds", _refund_view)
        )
        if "id" in request.path_params:
            row = self.store.one(f"SELECT * FROM {table} WHERE id = ?", request.path_params["id"])
            if row is None:
                raise ApiError(404, "invalid_request_error", "No such object", "resource_missing")
            return _json(200, view(row))
        key = request.query_params.get("idempotency_key")
        if key is not None:
            row = self.store.one(f"SELECT * FROM {table} WHERE idempotency_key = ? ORDER BY created", key)
            if row is None:
                raise ApiError(
                    404, "invalid_request_error", f"No {table[:-1]} with that key", "resource_missing"
                )
            return _json(200, view(row))
        limit = min(int(request.query_params.get("limit", "100")), 1000)
        rows = self.store.db.execute(
            f"SELECT * FROM {table} ORDER BY created DESC LIMIT ?", (limit,)
        ).fetchall()
        return _json(200, {"object": "list", "data": [view(dict(r)) for r in rows]})

    async def config(self, request: Request) -> Response:
        if request.method == "POST":
            try:
                reset = request.query_params.get("reset") == "1"
                self.settings.update(await _body(request), reset=reset)
            except ApiError as exc:
                return _json(exc.status, exc.body())
            except ValueError as exc:
                return _json(400, {"error": {"type": "invalid_request_error", "message": str(exc)}})
            self.faults.injected = 0
        return _json(200, self.settings.public())

    async def health(self, request: Request) -> Response:
        return _json(200, {"ok": True, "store": str(self.store.path)})


async def _body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body() or b"{}")
    except ValueError:
        raise ApiError(400, "invalid_request_error", "the body is not JSON", "parameter_invalid") from None
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_request_error", "the body must be a JSON object", "parameter_invalid")
    return body


def create_app(db: Path | str, settings: Settings | None = None) -> Starlette:
    """The sandbox as an ASGI app on the store at `db` (created if missing)."""
    api = Api(Store(Path(db)), settings or Settings())
    routes = [
        Route("/v1/charges", api.v1, methods=["GET", "POST"]),
        Route("/v1/charges/{id}", api.v1, methods=["GET"]),
        Route("/v1/charges/{id}/refunds", api.v1, methods=["POST"]),
        Route("/v1/refunds", api.v1, methods=["GET", "POST"]),
        Route("/v1/refunds/{id}", api.v1, methods=["GET"]),
        Route("/_sandbox/config", api.config, methods=["GET", "POST"]),
        Route("/_sandbox/health", api.health, methods=["GET"]),
    ]
    return Starlette(routes=routes)


def run_sandbox(
    db: Path | str, settings: Settings | None = None, *, host: str = "127.0.0.1", port: int = DEFAULT_PORT
) -> None:
    """Serve until interrupted; prints one line `commitgate sandbox: listening on URL` when ready."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)  # connections queue from here on, so "ready" is true as soon as it is printed
    url = f"http://{host}:{sock.getsockname()[1]}"
    app = create_app(db, settings)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
    print(f"{READY_PREFIX}{url} (store: {db})", flush=True)
    server.run(sockets=[sock])


# --- command line --------------------------------------------------------------------------------


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number between 0 and 1") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not a probability: use a number between 0 and 1")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0.0 <= value <= 86400.0:
        raise argparse.ArgumentTypeError(f"{text} is out of range: use 0 to 86400 seconds")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0-65535)") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port number: use 0-65535 (0 picks a free one)")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `commitgate sandbox`, also those of this module run on its own."""
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on; loopback unless you mean it (default: 127.0.0.1)",
    )
    parser.add_argument(
        "--port",
        type=_port,
        default=DEFAULT_PORT,
        help=f"TCP port, 0 picks a free one (default: {DEFAULT_PORT})",
    )
    parser.add_argument("--db", help="store file, SQLite (default: sandbox-api.db in the current directory)")
    parser.add_argument(
        "--no-idempotency",
        action="store_true",
        help="ignore Idempotency-Key, so every POST acts again (default: honoured, like Stripe)",
    )
    parser.add_argument(
        "--lose-response",
        type=_probability,
        default=0.0,
        metavar="P",
        help="probability, 0 to 1, that a successful POST loses its answer AFTER the charge or refund"
        " was stored: the effect happened, the client never hears (default: 0)",
    )
    parser.add_argument(
        "--lose-mode",
        choices=["drop", "hang"],
        default="drop",
        help="how an answer is lost: drop the connection, or hang --hang seconds (default: drop)",
    )
    parser.add_argument(
        "--hang", type=_seconds, default=30.0, metavar="S", help="seconds a lost answer hangs (default: 30)"
    )
    parser.add_argument(
        "--latency",
        type=_seconds,
        default=0.0,
        metavar="S",
        help="seconds added before every /v1 request (default: 0)",
    )
    parser.add_argument(
        "--fail-5xx",
        type=_probability,
        default=0.0,
        metavar="P",
        help="probability, 0 to 1, of answering 500 BEFORE doing anything (default: 0)",
    )
    parser.add_argument(
        "--rate-limit",
        type=_probability,
        default=0.0,
        metavar="P",
        help="probability, 0 to 1, of answering 429 BEFORE doing anything (default: 0)",
    )
    parser.add_argument(
        "--retry-after",
        type=_seconds,
        default=1.0,
        metavar="S",
        help="seconds a 429 asks the client to wait, in Retry-After (default: 1)",
    )
    parser.add_argument(
        "--fault-budget",
        type=int,
        default=None,
        metavar="N",
        help="inject at most N faults in all, then behave (default: no limit)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="random seed for the fault dice, for repeatable runs (default: random)",
    )
    parser.add_argument(
        "--token-env",
        metavar="VAR",
        help="require `Authorization: Bearer $VAR` on /v1 (default: no authentication)",
    )
    parser.set_defaults(func=cmd_sandbox)


def settings_from(args: argparse.Namespace) -> Settings:
    token = None
    if args.token_env:
        token = os.environ.get(args.token_env)
        if not token:
            raise SystemExit(f"--token-env: environment variable {args.token_env} is not set")
    return Settings(
        idempotency=not args.no_idempotency,
        lose_response=args.lose_response,
        lose_mode=args.lose_mode,
        hang=args.hang,
        latency=args.latency,
        fail_5xx=args.fail_5xx,
        rate_limit=args.rate_limit,
        retry_after=args.retry_after,
        fault_budget=args.fault_budget,
        seed=args.seed,
        token=token,
    )


def cmd_sandbox(args: argparse.Namespace) -> int:
    db = Path(args.db or "sandbox-api.db")
    if db.is_dir():
        raise SystemExit(
            f"commitgate sandbox: --db {db} is a directory; give a file name, e.g. {db / 'sandbox-api.db'}"
        )
    try:
        run_sandbox(db, settings_from(args), host=args.host, port=args.port)
    except KeyboardInterrupt:
        return 130
    except sqlite3.Error as exc:
        raise SystemExit(f"commitgate sandbox: cannot open the store {db}: {exc}") from None
    except (OSError, OverflowError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise SystemExit(f"commitgate sandbox: cannot listen on {args.host}:{args.port}: {reason}") from None
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="commitgate sandbox", description=(__doc__ or "").split("\n\n")[0])
    add_arguments(parser)
    return cmd_sandbox(parser.parse_args(argv))


# --- a sandbox in a child process (tests, demo, bench) -------------------------------------------


class SandboxProcess:
    """`python -m commitgate.server.demo.payments_api --port 0 ...` in a child process, and its store."""

    def __init__(self, db: Path, *flags: str, env: dict[str, str] | None = None) -> None:
        self.db = db
        command = [
            sys.executable,
            "-m",
            "commitgate.server.demo.payments_api",
            "--port",
            "0",
            "--db",
            str(db),
            *flags,
        ]
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line.startswith(READY_PREFIX):
            self.stop()
            raise RuntimeError(f"the sandbox did not start (exit {self.process.returncode}): {line!r}")
        self.url = line.removeprefix(READY_PREFIX).split()[0]

    def configure(self, *, reset: bool = True, **settings: Any) -> dict[str, Any]:
        """Set faults and idempotency of the running sandbox (by default all others back to their
        defaults); the fault count starts again from zero."""
        import httpx2

        url = f"{self.url}/_sandbox/config" + ("?reset=1" if reset else "")
        response = httpx2.post(url, json=settings, timeout=10.0)
        response.raise_for_status()
        return dict(response.json())

    def rows(self, table: str, **where: Any) -> list[dict[str, Any]]:
        clause = " AND ".join(f"{name} = ?" for name in where) or "1"
        with contextlib.closing(sqlite3.connect(self.db)) as db:
            db.row_factory = sqlite3.Row
            cursor = db.execute(f"SELECT * FROM {table} WHERE {clause} ORDER BY rowid", tuple(where.values()))
            return [dict(row) for row in cursor.fetchall()]

    def count(self, table: str, **where: Any) -> int:
        return len(self.rows(table, **where))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()

    def __enter__(self) -> SandboxProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    sys.exit(main())
