"""Monitoring files shipped with commitgate: Prometheus alerting rules and a Grafana dashboard.

`commitgate-alerts.yml` loads into Prometheus (`rule_files:`); `commitgate-dashboard.json` imports
into Grafana (Dashboards > Import) over the Prometheus that scrapes `/metrics`.
docs/operating.md#traces-alerts-and-a-dashboard says what each alert means; `files()` tells where they were installed.
"""

from __future__ import annotations

from pathlib import Path

DIRECTORY = Path(__file__).resolve().parent
RULES = DIRECTORY / "commitgate-alerts.yml"
DASHBOARD = DIRECTORY / "commitgate-dashboard.json"


def files() -> dict[str, Path]:
    return {"rules": RULES, "dashboard": DASHBOARD}
