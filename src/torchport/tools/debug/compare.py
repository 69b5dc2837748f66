"""Comparing tensors and op dumps: where does a device run first leave the CPU's?

:func:`tensor_diff` is the measure every tool shares (autocompare, module
comparison, dump comparison): max absolute and relative error, number of
elements outside ``atol + rtol * |expected|``, cosine similarity, with
``torch.testing.assert_close``'s dtype-aware default tolerances.

:func:`compare_dumps` lines up two op dumps (``torchport.tools.debug.opdump``): the
top-level calls of each (depth 0, metadata-only views and uninitialised
allocations left out) are aligned by op name with a longest-common-subsequence
match, so calls only one side makes (host-to-device copies, ops PyTorch
dispatches differently to a backend than to a CPU dispatch mode) do not shift
the rest. Each aligned pair's outputs are compared; the first pair beyond
tolerance is the first divergent call.
"""

from __future__ import annotations

import difflib
import html
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

MANIFEST = "manifest.jsonl"
FORMAT = "torchport-op-dump"
# Ops whose results are uninitialised memory or pure metadata: never compared by value.
UNINITIALISED = frozenset({
    "empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like", "resize_",
    "resize_as_", "_resize_output_", "set_", "_empty_affine_quantized", "empty_permuted",
    "record_stream", "_pin_memory", "is_pinned",
})


class DumpFormatError(ValueError):
    """A directory is not a readable op dump."""


# ---- tensor comparison ------------------------------------------------------
def tolerances(dtype: torch.dtype, rtol: float | None = None,
               atol: float | None = None) -> tuple[float, float]:
    """(rtol, atol): the given ones, else ``torch.testing.assert_close``'s for ``dtype``."""
    if rtol is not None and atol is not None:
        return rtol, atol
    try:
        from torch.testing._comparison import default_tolerances
        r, a = default_tolerances(dtype)
    except Exception:  # pragma: no cover - private API moved
        r, a = (1.3e-6, 1e-5) if dtype.is_floating_point or dtype.is_complex else (0.0, 0.0)
    return (r if rtol is None else rtol), (a if atol is None else atol)


@dataclass
class TensorDiff:
    """How far ``actual`` is from ``expected``."""

    ok: bool
    max_abs: float = 0.0
    max_rel: float = 0.0
    mismatched: int = 0
    numel: int = 0
    cosine: float | None = None
    reason: str = ""  # "" for a value comparison, else "shape", "dtype", ...

    def short(self) -> str:
        if self.reason:
            return self.reason
        cos = "-" if self.cosine is None else f"{self.cosine:.6f}"
        return (f"max abs {self.max_abs:.3g}, max rel {self.max_rel:.3g}, "
                f"{self.mismatched}/{self.numel} mismatched, cos {cos}")


def _real64(t: torch.Tensor) -> torch.Tensor:
    if t.is_complex():
        return torch.view_as_real(t.to(torch.complex128)).reshape(-1)
    return t.to(torch.float64).reshape(-1)


def tensor_diff(actual: torch.Tensor, expected: torch.Tensor, rtol: float | None = None,
                atol: float | None = None, check_dtype: bool = True) -> TensorDiff:
    """Compare two CPU tensors (NaN equals NaN, equal infinities are equal)."""
    if actual.shape != expected.shape:
        return TensorDiff(False, math.inf, math.inf, expected.numel(), expected.numel(),
                          None, f"shape {list(actual.shape)} != {list(expected.shape)}")
    if check_dtype and actual.dtype != expected.dtype:
        return TensorDiff(False, math.inf, math.inf, expected.numel(), expected.numel(), None,
                          f"dtype {str(actual.dtype).removeprefix('torch.')} != "
                          f"{str(expected.dtype).removeprefix('torch.')}")
    n = expected.numel()
    if n == 0:
        return TensorDiff(True, numel=0, cosine=1.0)
    r, a = tolerances(expected.dtype, rtol, atol)
    if actual.layout != torch.strided or actual.is_quantized:
        actual, expected = actual.to_dense(), expected.to_dense()
    if expected.is_complex() or actual.is_complex():
        x = actual.to(torch.complex128)
        y = expected.to(torch.complex128)
        both_nan = x.isnan() & y.isnan()
    else:
        x = actual.to(torch.float64)
        y = expected.to(torch.float64)
        both_nan = x.isnan() & y.isnan()
    diff = (x - y).abs()
    same = (x == y) | both_nan
    diff = torch.where(same, torch.zeros_like(diff), diff)
    diff = torch.nan_to_num(diff, nan=math.inf)
    bad = ~same & ~(diff <= a + r * y.abs())
    mismatched = int(bad.sum())
    max_abs = float(diff.max())
    ay = y.abs()
    rel = torch.where(ay > 0, diff / torch.where(ay > 0, ay, torch.ones_like(ay)),
                      torch.where(diff > 0, torch.full_like(diff, math.inf), diff))
    max_rel = float(rel.max())
    return TensorDiff(mismatched == 0, max_abs, max_rel, mismatched, n,
                      cosine_similarity(actual, expected))


def cosine_similarity(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """Cosine of the angle between two tensors (over elements finite in both)."""
    if a.numel() == 0 or a.shape != b.shape:
        return None
    x, y = _real64(a), _real64(b)
    keep = x.isfinite() & y.isfinite()
    if not bool(keep.all()):
        x, y = x[keep], y[keep]
    nx, ny = float(x.norm()), float(y.norm())
    if nx == 0.0 and ny == 0.0:
        return 1.0
    if nx == 0.0 or ny == 0.0:
        return 0.0
    return float((x @ y) / (nx * ny))


def value_diff(actual: Any, expected: Any, rtol: float | None = None,
               atol: float | None = None) -> TensorDiff:
    """:func:`tensor_diff` for tensors; scalars, ``None`` and the rest compared by value."""
    if isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor):
        return tensor_diff(actual, expected, rtol, atol)
    if isinstance(actual, torch.Tensor) or isinstance(expected, torch.Tensor):
        return TensorDiff(False, math.inf, math.inf, 1, 1, None,
                          f"type {type(actual).__name__} != {type(expected).__name__}")
    if isinstance(actual, (float, complex)) or isinstance(expected, (float, complex)):
        try:
            return tensor_diff(torch.tensor(complex(actual)), torch.tensor(complex(expected)),
                               rtol, atol, check_dtype=False)
        except (TypeError, ValueError):
            pass
    same = actual == expected
    return TensorDiff(bool(same), 0.0 if same else math.inf, 0.0 if same else math.inf,
                      0 if same else 1, 1, None, "" if same else f"{actual!r} != {expected!r}")


# ---- dumps ------------------------------------------------------------------
@dataclass
class DumpEntry:
    """One call of a dump's manifest."""

    data: dict[str, Any]
    root: Path

    @property
    def index(self) -> int:
        return int(self.data["index"])

    @property
    def op(self) -> str:
        return str(self.data["op"])

    @property
    def key(self) -> str:
        """The alignment key: the op's name without overload (``add.out`` -> ``add``)."""
        return self.op.split(".", 1)[0]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The saved tensors of this call (``in.<arg>``, ``out.<i>``), or ``{}``."""
        name = self.data.get("file")
        if not name:
            return {}
        path = self.root / name
        if name.endswith(".safetensors"):
            from safetensors.torch import load_file
            return load_file(str(path))
        return torch.load(path, map_location="cpu", weights_only=True)


@dataclass
class Dump:
    """A loaded op dump: its header and its calls in index order."""

    root: Path
    header: dict[str, Any]
    entries: list[DumpEntry]


def load_dump(directory: str | Path) -> Dump:
    """Read ``manifest.jsonl`` of a dump directory (raises :class:`DumpFormatError`)."""
    root = Path(directory)
    path = root / MANIFEST
    if not root.is_dir():
        raise DumpFormatError(f"{root}: no such directory")
    if not path.is_file():
        raise DumpFormatError(f"{root}: no {MANIFEST} (not a torchport op dump)")
    header: dict[str, Any] = {}
    entries = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise DumpFormatError(f"{path}: not a text manifest ({e.reason} at byte {e.start}); "
                              f"point at the directory TORCHPORT_DUMP_DIR wrote") from None
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise DumpFormatError(f"{path}:{n}: bad JSON ({e})") from None
        if not isinstance(d, dict):
            raise DumpFormatError(f"{path}:{n}: not a JSON object")
        if d.get("format") == FORMAT:
            header = d
        elif "index" in d and "op" in d:
            entries.append(DumpEntry(d, root))
        else:
            raise DumpFormatError(f"{path}:{n}: neither a header nor a call")
    if not header:
        raise DumpFormatError(f"{path}: no {FORMAT} header line")
    entries.sort(key=lambda e: e.index)
    return Dump(root, header, entries)


def _comparable(e: DumpEntry, nested: bool) -> bool:
    d = e.data
    if not nested and d.get("depth", 0):
        return False
    return not d.get("view") and d.get("path") != "view" and e.key not in UNINITIALISED


@dataclass
class DumpRow:
    """One aligned call (or a call only one dump has)."""

    op: str
    index_a: int | None
    index_b: int | None
    status: str  # "ok", "diverged", "only in A", "only in B", "no data", "unreadable"
    cosine: float | None = None
    max_abs: float | None = None
    max_rel: float | None = None
    mismatched: int = 0
    numel: int = 0
    note: str = ""

    @property
    def divergent(self) -> bool:
        return self.status == "diverged"

    def cells(self) -> list[str]:
        def f(v: float | None, fmt: str) -> str:
            return "-" if v is None else format(v, fmt)
        return [("-" if self.index_a is None else str(self.index_a)),
                ("-" if self.index_b is None else str(self.index_b)), self.op, self.status,
                f(self.cosine, ".6f"), f(self.max_abs, ".3g"), f(self.max_rel, ".3g"),
                (f"{self.mismatched}/{self.numel}" if self.numel else "-"), self.note]


_HEADERS = ["#A", "#B", "op", "status", "cosine", "max abs", "max rel", "mismatched", "note"]


@dataclass
class DumpComparison:
    """The result of :func:`compare_dumps`."""

    dir_a: str
    dir_b: str
    rtol: float | None
    atol: float | None
    rows: list[DumpRow] = field(default_factory=list)

    @property
    def first_divergent(self) -> DumpRow | None:
        """The first aligned call whose outputs differ beyond tolerance."""
        return next((r for r in self.rows if r.divergent), None)

    @property
    def divergent(self) -> list[DumpRow]:
        return [r for r in self.rows if r.divergent]

    @property
    def unreadable(self) -> list[DumpRow]:
        """Calls whose saved tensors could not be read (a damaged or truncated file)."""
        return [r for r in self.rows if r.status == "unreadable"]

    @property
    def ok(self) -> bool:
        """Nothing diverged and every saved tensor could be read."""
        return self.first_divergent is None and not self.unreadable

    def summary(self) -> str:
        """One line: what diverged first, or that nothing did."""
        paired = sum(1 for r in self.rows if r.index_a is not None and r.index_b is not None)
        only = len(self.rows) - paired
        tol = ("default tolerances" if self.rtol is None and self.atol is None
               else f"rtol={self.rtol}, atol={self.atol}")
        head = f"{paired} calls aligned, {only} in one dump only ({tol}); "
        r = self.first_divergent
        bad = self.unreadable
        if bad:
            head += (f"{len(bad)} call(s) unreadable, first: {bad[0].op} (A #{bad[0].index_a}, "
                     f"B #{bad[0].index_b}) {bad[0].note}; ")
        if r is None:
            return head + ("no divergence among the readable calls" if bad else "no divergence")
        return (head + f"{len(self.divergent)} divergent; first divergent call: {r.op} "
                f"(A #{r.index_a}, B #{r.index_b}): max abs {r.max_abs:.3g}, "
                f"max rel {r.max_rel:.3g}, cosine "
                + ("-" if r.cosine is None else f"{r.cosine:.6f}")
                + (f" [{r.note}]" if r.note else ""))

    def _window(self, max_rows: int | None) -> list[DumpRow]:
        if max_rows is None or len(self.rows) <= max_rows:
            return self.rows
        r = self.first_divergent
        i = self.rows.index(r) if r is not None else 0
        lo = max(0, min(i - max_rows // 2, len(self.rows) - max_rows))
        return self.rows[lo:lo + max_rows]

    def table(self, max_rows: int | None = 40) -> Any:
        """A rich Table (around the first divergence when longer than ``max_rows``)."""
        from rich.table import Table
        t = Table(title=f"op dumps: A={self.dir_a}  B={self.dir_b}")
        for h in _HEADERS:
            t.add_column(h, justify="right" if h.startswith("#") else "left")
        first = self.first_divergent
        for r in self._window(max_rows):
            style = ("bold red" if r is first else "red" if r.divergent
                     else "dim" if r.status.startswith("only") else None)
            t.add_row(*r.cells(), style=style)
        return t

    def to_markdown(self) -> str:
        """A Markdown report with every row."""
        lines = ["# torchport op dump comparison", "",
                 f"- A: `{self.dir_a}`", f"- B: `{self.dir_b}`", f"- {self.summary()}", "",
                 "| " + " | ".join(_HEADERS) + " |", "|" + "---|" * len(_HEADERS)]
        for r in self.rows:
            cells = [c.replace("|", "\\|") for c in r.cells()]
            if r is self.first_divergent:
                cells[3] = f"**{cells[3]}**"
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines) + "\n"

    def to_html(self) -> str:
        """A standalone HTML report with every row (divergent rows in red)."""
        e = html.escape
        first = self.first_divergent
        body = []
        for r in self.rows:
            cls = ("first" if r is first else "div" if r.divergent
                   else "only" if r.status.startswith("only") else "")
            body.append(f'<tr class="{cls}">' + "".join(f"<td>{e(c)}</td>" for c in r.cells())
                        + "</tr>")
        return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
                "<title>torchport op dump comparison</title><style>"
                "body{font-family:sans-serif}table{border-collapse:collapse}"
                "td,th{border:1px solid #ccc;padding:2px 6px;font-family:monospace}"
                "tr.div{background:#fdd}tr.first{background:#f99;font-weight:bold}"
                "tr.only{color:#888}</style></head><body>"
                "<h1>torchport op dump comparison</h1>"
                f"<p>A: <code>{e(self.dir_a)}</code><br>B: <code>{e(self.dir_b)}</code></p>"
                f"<p>{e(self.summary())}</p><table><tr>"
                + "".join(f"<th>{e(h)}</th>" for h in _HEADERS) + "</tr>\n"
                + "\n".join(body) + "\n</table></body></html>\n")

    def write_report(self, path: str | Path) -> Path:
        """Write Markdown (``.md``) or HTML (``.html``/``.htm``) by the file's suffix."""
        p = Path(path)
        text = self.to_html() if p.suffix.lower() in (".html", ".htm") else self.to_markdown()
        p.write_text(text)
        return p


def _stats_diff(ma: dict, mb: dict, rtol: float | None, atol: float | None) -> TensorDiff:
    """Compare two tensors known only by their summary statistics."""
    sa, sb = ma.get("stats") or {}, mb.get("stats") or {}
    if ma.get("shape") != mb.get("shape"):
        return TensorDiff(False, math.inf, math.inf, 1, 1, None,
                          f"shape {ma.get('shape')} != {mb.get('shape')}")
    keys = [k for k in ("min", "max", "mean", "std") if isinstance(sa.get(k), (int, float))
            and isinstance(sb.get(k), (int, float))]
    if not keys:
        return TensorDiff(True, reason="no data")
    x = torch.tensor([float(sa[k]) for k in keys], dtype=torch.float64)
    y = torch.tensor([float(sb[k]) for k in keys], dtype=torch.float64)
    r, a = tolerances(getattr(torch, mb.get("dtype", "float32"), torch.float32), rtol, atol)
    d = tensor_diff(x, y, r, a)
    d.reason = "" if d.ok else "stats differ"
    d.cosine = None
    return d


def _flat_meta(items: list[dict], prefix: str) -> list[dict]:
    out = []
    for m in items:
        if m.get("type") == "list":
            out.extend(_flat_meta(m.get("items", []), prefix))
        elif m.get("type") == "tensor":
            out.append(m)
    return out


def _compare_metas(ma: list[dict], mb: list[dict], ta: dict, tb: dict, rtol: float | None,
                   atol: float | None) -> tuple[list[TensorDiff], bool]:
    diffs, have_data = [], True
    for x, y in zip(ma, mb, strict=False):
        ka, kb = x.get("key"), y.get("key")
        if ka in ta and kb in tb:
            diffs.append(tensor_diff(ta[ka], tb[kb], rtol, atol, check_dtype=False))
        else:
            have_data = False
            diffs.append(_stats_diff(x, y, rtol, atol))
    if len(ma) != len(mb):
        diffs.append(TensorDiff(False, math.inf, math.inf, 1, 1, None,
                                f"{len(ma)} != {len(mb)} tensors"))
    return diffs, have_data


def _pair_row(a: DumpEntry, b: DumpEntry, rtol: float | None, atol: float | None) -> DumpRow:
    try:
        ta, tb = a.tensors(), b.tensors()
    except Exception as e:  # a damaged file: report, do not abort the comparison
        return DumpRow(a.op, a.index, b.index, "unreadable",
                       note=f"cannot read tensors: {type(e).__name__}: {e}")
    outs, have = _compare_metas(_flat_meta(a.data.get("outputs", []), "out"),
                                _flat_meta(b.data.get("outputs", []), "out"), ta, tb, rtol, atol)
    ins_a = {m["name"]: m for m in a.data.get("inputs", []) if not m.get("written")}
    ins_b = {m["name"]: m for m in b.data.get("inputs", []) if not m.get("written")}
    common = [n for n in ins_a if n in ins_b]
    ins, _ = _compare_metas(_flat_meta([ins_a[n] for n in common], "in"),
                            _flat_meta([ins_b[n] for n in common], "in"), ta, tb, rtol, atol)
    op = a.op if a.op == b.op else f"{a.op} / {b.op}"
    notes = []
    if a.data.get("error") or b.data.get("error"):
        notes.append("error: " + str(a.data.get("error") or b.data.get("error")))
    if any(not d.ok for d in ins):
        notes.append("inputs differ")
    if not have:
        notes.append("stats only")
    if not outs:
        return DumpRow(op, a.index, b.index, "ok", note="; ".join(notes + ["no tensor outputs"]))
    bad = [d for d in outs if not d.ok]
    reasons = sorted({d.reason for d in bad if d.reason and d.reason != "stats differ"})
    notes.extend(reasons)
    cos = [d.cosine for d in outs if d.cosine is not None]
    return DumpRow(op, a.index, b.index, "diverged" if bad else "ok",
                   min(cos) if cos else None, max(d.max_abs for d in outs),
                   max(d.max_rel for d in outs), sum(d.mismatched for d in outs),
                   sum(d.numel for d in outs), "; ".join(notes))


def compare_dumps(dir_a: str | Path, dir_b: str | Path, rtol: float | None = None,
                  atol: float | None = None, nested: bool = False) -> DumpComparison:
    """Line up two op dumps and compare each aligned call's outputs.

    ``rtol``/``atol`` default to ``torch.testing.assert_close``'s per dtype.
    ``nested=True`` also aligns calls made inside other calls (decompositions).
    Raises :class:`DumpFormatError` when a directory is not a dump."""
    da, db = load_dump(dir_a), load_dump(dir_b)
    ea = [e for e in da.entries if _comparable(e, nested)]
    eb = [e for e in db.entries if _comparable(e, nested)]
    result = DumpComparison(str(dir_a), str(dir_b), rtol, atol)
    sm = difflib.SequenceMatcher(None, [e.key for e in ea], [e.key for e in eb], autojunk=False)
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal":
            for a, b in zip(ea[i1:i2], eb[j1:j2], strict=True):
                result.rows.append(_pair_row(a, b, rtol, atol))
            continue
        for a in ea[i1:i2]:
            result.rows.append(DumpRow(a.op, a.index, None, "only in A"))
        for b in eb[j1:j2]:
            result.rows.append(DumpRow(b.op, None, b.index, "only in B"))
    return result
