"""What checking an `[auth.oauth]` access token costs per call, with the issuer's keys cached.

    python -m commitgate.server.bench.oauth [--calls N] [--rounds R] [--json]

In one process: a key of each accepted algorithm (RS256 with RSA-2048, ES256, EdDSA), published
as a JWKS the verifier has already fetched, and one token per algorithm with the claims a
provider puts in (iss, aud, exp, iat, sub, scope, client_id, jti). Each round times N checks of
each token (`OAuthVerifier.verify`: header, key lookup, signature, claims, role) in CPU time (the
process's own, so other work on a shared machine does not count), and the
figures are the medians over rounds of the time per check. The static-token table's lookup is
timed beside them, for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

from commitgate.server.policy.models import AuthPolicy, AuthToken
from commitgate.server.policy.oauth import OAuthPolicy
from commitgate.server.policy.tokens import load_tokens
from commitgate.server.serve.oauth import OAuthVerifier, ProviderKeys, parse_keys

ISSUER, AUDIENCE = "https://idp.example.com/realms/team", "https://mcp.example.com/mcp"
STATIC = "static-token-0123456789abcdef"


def _keys() -> dict[str, Any]:
    return {
        "RS256": rsa.generate_private_key(public_exponent=65537, key_size=2048),
        "ES256": ec.generate_private_key(ec.SECP256R1()),
        "EdDSA": ed25519.Ed25519PrivateKey.generate(),
    }


def _verifier(keys: dict[str, Any]) -> OAuthVerifier:
    published = []
    for alg, key in keys.items():
        jwk = json.loads(jwt.get_algorithm_by_name(alg).to_jwk(key.public_key()))
        published.append({**jwk, "kid": alg.lower(), "alg": alg, "use": "sig"})
    provider = ProviderKeys(ISSUER)
    provider.keys = parse_keys({"keys": published})  # as if fetched: the cache is what is measured
    return OAuthVerifier(OAuthPolicy(issuer=ISSUER, resource=AUDIENCE), provider)


def _token(alg: str, key: Any) -> str:
    now = int(time.time())
    claims = {
        "iss": ISSUER,
        "aud": AUDIENCE,
        "sub": "billing-agent",
        "client_id": "billing-agent",
        "scope": "mcp",
        "iat": now,
        "exp": now + 3600,
        "jti": "b1c6a2f0d9e84c3a",
    }
    return jwt.encode(claims, key, algorithm=alg, headers={"kid": alg.lower(), "typ": "at+jwt"})


async def _round(verifier: OAuthVerifier, tokens: dict[str, str], calls: int) -> dict[str, float]:
    per_call: dict[str, float] = {}
    for alg, token in tokens.items():
        start = time.process_time()
        for _ in range(calls):
            await verifier.verify(token)
        per_call[alg] = (time.process_time() - start) / calls * 1e6
    table = load_tokens(AuthPolicy(tokens=[AuthToken(principal="a", token_env="T")]), {"T": STATIC})
    start = time.process_time()
    for _ in range(calls):
        table.holder_of(STATIC)
    per_call["static token"] = (time.process_time() - start) / calls * 1e6
    return per_call


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    keys = _keys()
    verifier = _verifier(keys)
    tokens = {alg: _token(alg, key) for alg, key in keys.items()}
    rounds = [asyncio.run(_round(verifier, tokens, args.calls)) for _ in range(args.rounds)]
    medians = {name: statistics.median(r[name] for r in rounds) for name in rounds[0]}
    if args.json:
        print(json.dumps({"microseconds_per_check": medians, "calls": args.calls, "rounds": args.rounds}))
    else:
        for name, value in medians.items():
            print(f"{name:>13}: {value:8.1f} µs per check (median of {args.rounds} rounds of {args.calls})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
