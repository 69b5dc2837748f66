"""The coverage report as one self-contained HTML page (inline CSS and SVG, no scripts).

A page can be attached to an issue or a CI artifact and opened anywhere: a bar
chart of host time (or, for a static trace, calls) per path, then every overload,
fallback ops first, since those are the ones that need kernels.
"""

from __future__ import annotations

import html
from typing import Any, Protocol

from torchport.tools.debug.coverage_paths import PATH_COLOR, PATH_ORDER


class Coverage(Protocol):
    """What the page reads of a :class:`torchport.tools.debug.opcoverage.CoverageResult`."""

    mode: str
    backend: str
    script: str | None
    args: list[str]
    exit_code: int
    error: str | None
    stopped_at: str | None
    forced_fallback: list[str]

    def calls_per_path(self) -> dict[str, int]: ...
    def ops_per_path(self) -> dict[str, int]: ...
    def time_per_path(self) -> dict[str, float]: ...
    def rows(self) -> list[Any]: ...
    def summary(self) -> str: ...

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2em;color:#222}
h1{font-size:1.4em} h2{font-size:1.1em;margin-top:1.6em}
table{border-collapse:collapse;font-size:.9em} th,td{padding:.25em .7em;text-align:left}
th{border-bottom:2px solid #444} td{border-bottom:1px solid #ddd}
td.n{text-align:right;font-variant-numeric:tabular-nums}
.path{display:inline-block;padding:0 .5em;border-radius:3px;color:#fff;font-size:.85em}
.meta td{border:none;padding:.1em .7em .1em 0}
.warn{color:#a94442}
"""


def _esc(x: object) -> str:
    return html.escape(str(x), quote=True)


def bar_chart_svg(values: dict[str, float], unit: str, colors: dict[str, str],
                  width: int = 560) -> str:
    """A horizontal bar chart as inline SVG (one bar per key)."""
    bar_h, gap, label_w, value_w = 22, 8, 100, 120
    top = max(values.values(), default=0.0) or 1.0
    span = width - label_w - value_w
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" width="{width}" '
             f'height="{len(values) * (bar_h + gap) + gap}" role="img" '
             f'aria-label="{_esc(unit)} per path">']
    for i, (key, v) in enumerate(values.items()):
        y = gap + i * (bar_h + gap)
        w = max(int(span * v / top), 1 if v else 0)
        text = f"{v:.3f} {unit}" if isinstance(v, float) and unit == "ms" else f"{v:g} {unit}"
        parts.append(
            f'<text x="0" y="{y + 16}" font-size="13">{_esc(key)}</text>'
            f'<rect class="bar bar-{_esc(key)}" x="{label_w}" y="{y}" width="{w}" '
            f'height="{bar_h}" fill="{colors.get(key, "#888")}"><title>{_esc(key)}: '
            f'{_esc(text)}</title></rect>'
            f'<text x="{label_w + w + 6}" y="{y + 16}" font-size="12">{_esc(text)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def render_html(result: Coverage) -> str:
    """The whole report page for ``result``."""
    static = result.mode == "static"
    calls, nops, secs = result.calls_per_path(), result.ops_per_path(), result.time_per_path()
    title = f"torchport op coverage: {result.script or 'code block'}"
    meta = [("mode", "static trace on fake tensors (nothing ran on the device)" if static
             else "recorded while running on the device"),
            ("backend", result.backend),
            ("command", " ".join([result.script or "", *result.args]).strip() or "-"),
            ("exit code", str(result.exit_code)),
            ("summary", result.summary())]
    if result.forced_fallback:
        meta.append(("forced to fallback", ", ".join(result.forced_fallback)))
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           f"<title>{_esc(title)}</title><style>{_CSS}</style></head><body>",
           f"<h1>{_esc(title)}</h1>", '<table class="meta">']
    out += [f"<tr><td><b>{_esc(k)}</b></td><td>{_esc(v)}</td></tr>" for k, v in meta]
    out.append("</table>")
    if result.stopped_at:
        out.append(f'<p class="warn">Static trace {_esc(result.stopped_at)}</p>')
    if result.error:
        out.append(f'<p class="warn">Script failed: {_esc(result.error)}</p>')
    if static:
        out.append("<h2>Calls per path</h2>")
        out.append(bar_chart_svg({p: float(calls[p]) for p in PATH_ORDER}, "calls", PATH_COLOR))
    else:
        out.append("<h2>Host time per path</h2>")
        out.append(bar_chart_svg({p: secs[p] * 1e3 for p in PATH_ORDER}, "ms", PATH_COLOR))
        out.append("<p><small>A decomposed op's time includes the device ops it runs "
                   "(they also have rows of their own).</small></p>")
    out.append('<table class="totals"><tr><th>path</th><th>overloads</th><th>calls</th>'
               + ("" if static else "<th>host ms</th>") + "</tr>")
    for p in PATH_ORDER:
        out.append(f'<tr><td><span class="path" style="background:{PATH_COLOR[p]}">{p}</span>'
                   f'</td><td class="n">{nops[p]}</td><td class="n">{calls[p]}</td>'
                   + ("" if static else f'<td class="n">{secs[p] * 1e3:.3f}</td>') + "</tr>")
    out.append("</table>")
    out.append("<h2>Overloads (fallback first)</h2>")
    out.append('<table class="ops"><tr><th>path</th><th>overload</th><th>calls</th>'
               "<th>paths</th><th>dtypes</th>" + ("" if static else "<th>host ms</th>")
               + "</tr>")
    for o in result.rows():
        paths = " ".join(f"{p}:{n}" for p, n in sorted(o.paths.items()))
        out.append(
            f'<tr class="op op-{o.path}"><td><span class="path" '
            f'style="background:{PATH_COLOR.get(o.path, "#888")}">{o.path}</span></td>'
            f"<td><code>{_esc(o.name)}</code></td><td class=\"n\">{o.calls}</td>"
            f"<td>{_esc(paths)}</td><td>{_esc(', '.join(o.dtypes))}</td>"
            + ("" if static else f'<td class="n">{o.host_time_s * 1e3:.3f}</td>') + "</tr>")
    out.append("</table></body></html>")
    return "\n".join(out) + "\n"
