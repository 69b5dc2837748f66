"""The op paths in the coverage report's order, and their colours.

Shared by the coverage records (:mod:`torchport.tools.debug.opcoverage`: an op's worst path, the
rich table) and the HTML page (:mod:`torchport.tools.debug.report_html`), which reads a result
without importing the records.
"""

from __future__ import annotations

PATH_ORDER = ("fallback", "decomposed", "native", "view")  # worst first: the report's groups
PATH_STYLE = {"fallback": "bold red", "decomposed": "yellow", "native": "green", "view": "cyan"}
PATH_COLOR = {"fallback": "#d9534f", "decomposed": "#e0a800", "native": "#28a745",
              "view": "#17a2b8"}
