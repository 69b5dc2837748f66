"""The op paths in the coverage report's order, and their colours.

Shared by the coverage records (:mod:`torchport.tools.debug.opcoverage`: an op's worst path, the
rich table) and the HTML page (:mod:`torchport.tools.debug.report_html`), which reads a result
without importing the records.
"""

from __future__ import annotations

# worst first: the report's groups. ``composite``: PyTorch computed the op from others above
# the backend (no device kernel of its own); ``torchport``: torchport's own kernels
# (allocation, copies, resize_, set_, its device routes), apart from the vendor's ``native``.
PATH_ORDER = ("fallback", "decomposed", "composite", "native", "torchport", "view")
PATH_STYLE = {"fallback": "bold red", "decomposed": "yellow", "composite": "magenta",
              "native": "green", "torchport": "blue", "view": "cyan"}
PATH_COLOR = {"fallback": "#d9534f", "decomposed": "#e0a800", "composite": "#9b59b6",
              "native": "#28a745", "torchport": "#3b6fd6", "view": "#17a2b8"}
