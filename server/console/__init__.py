"""`commitgate console`: the operator's web page over the ledger (docs/architecture.md#the-console).

A command layer: it reads and writes the same ledger as the servers (so it works beside a stdio
server started by Claude Desktop) and records decisions through the same core functions as
`commitgate ops`. Each page is one module in `pages/` and one template in `templates/`.
"""
