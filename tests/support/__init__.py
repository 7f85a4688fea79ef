"""Helpers the tests share: fixtures live in conftest.py, everything they use lives here.

- boundary: a system of record that counts effects, and test tools for the commit boundary
- e2e: `commitgate serve` processes over stdio with the SDK client (deployments, servers)
- http_servers: `commitgate serve` over streamable HTTP and SSE
- ledgers: the ledger backends every contract test runs on
- policy: running `commitgate policy` commands in process
- postgres: a throwaway database and a fresh schema per ledger
- replicas: several HTTP servers on one PostgreSQL ledger
- upstream_server: a small MCP server to wrap (also run as a script)
- wrapping: the sandbox HTTP API and upstream servers as things to wrap
"""
