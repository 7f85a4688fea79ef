"""The console's pages. Each is one module (its routes and a `PAGE` entry) and one template.

To add a page: write `pages/NAME.py` with `PAGE = Page(...)` and its routes, its template in
`templates/`, and name it in `PAGES` below; the navigation follows this order.
"""

from __future__ import annotations

from commitgate.server.console.pages import approvals, budgets, operations, unknown
from commitgate.server.console.pages.base import Page

PAGES: tuple[Page, ...] = (approvals.PAGE, unknown.PAGE, operations.PAGE, budgets.PAGE)

__all__ = ["PAGES", "Page"]
