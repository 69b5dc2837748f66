"""The conformance report: a summary per status and per op path, written as JSON and as
Markdown."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from torchport.tools.conformance import catalog


# ---- report ------------------------------------------------------------------------
def core_overloads_by_slot() -> tuple[list[str], list[str]]:
    """Core ATen overloads (``torch.Tag.core``): (with a backend slot, decomposed above the
    backend by a CompositeImplicitAutograd kernel)."""
    import torch

    from torchport.ops.registry import _has_backend_slot

    slot, above = [], []
    for schema in torch._C._jit_get_all_schemas():
        if not schema.name.startswith("aten::"):
            continue
        base, overload = schema.name[len("aten::"):], schema.overload_name
        packet = getattr(torch.ops.aten, base, None)
        try:
            op = getattr(packet, overload or "default") if packet is not None else None
        except (AttributeError, RuntimeError):
            op = None
        if op is None or torch.Tag.core not in op.tags:
            continue
        name = base + ("." + overload if overload else "")
        (slot if _has_backend_slot(op) else above).append(name)
    return sorted(set(slot)), sorted(set(above))


_STATUSES = ("pass", "known", "fail", "skip")


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals per OpInfo, per (OpInfo, dtype) and per gradient dtype, and the paths."""
    tot: dict[str, Any] = {"opinfos": dict.fromkeys(_STATUSES, 0),
                           "dtypes": {}, "grad": {}, "samples": {"passed": 0, "failed": 0,
                                                                 "skipped": 0},
                           "paths": {"native": 0, "decomposed": 0, "fallback": 0, "view": 0}}
    for r in results:
        tot["opinfos"][r["status"]] += 1
        for kind in ("dtypes", "grad"):
            for dt, v in r[kind].items():
                d = tot[kind].setdefault(dt, dict.fromkeys(_STATUSES, 0))
                d[v["status"]] += 1
                for k in ("passed", "failed", "skipped"):
                    tot["samples"][k] += v.get(k, 0)
    for kind in ("dtypes", "grad"):
        a = dict.fromkeys(_STATUSES, 0)
        for d in tot[kind].values():
            for k in _STATUSES:
                a[k] += d[k]
        ran = a["pass"] + a["known"] + a["fail"]
        tot[kind + "_all"] = {**a, "pass_rate": round(a["pass"] / ran, 4) if ran else None}
    o = tot["opinfos"]
    ran = o["pass"] + o["known"] + o["fail"]
    tot["opinfo_pass_rate"] = round(o["pass"] / ran, 4) if ran else None
    # every path of every overload, summed over the OpInfos (calls)
    calls: dict[str, dict[str, int]] = {}
    for r in results:
        counts = r.get("path_counts") or {n: {p: 1} for n, p in r.get("paths", {}).items()}
        for n, ps in counts.items():
            c = calls.setdefault(n, {})
            for p, k in ps.items():
                c[p] = c.get(p, 0) + k
    main = {n: max(c.items(), key=lambda kv: kv[1])[0] for n, c in calls.items()}
    for p in main.values():
        tot["paths"][p] = tot["paths"].get(p, 0) + 1
    tot["overload_paths"] = dict(sorted(main.items()))
    tot["overload_path_calls"] = dict(sorted(calls.items()))
    slot, above = core_overloads_by_slot()
    core: dict[str, Any] = {"overloads": len(slot) + len(above), "with_backend_slot": len(slot),
                            "above_backend": above, "by_path": {}, "not_exercised": []}
    for n in slot:
        if n not in calls:
            core["not_exercised"].append(n)
            continue
        for p in calls[n]:
            core["by_path"].setdefault(p, []).append(n)
    tot["core"] = core
    return tot


def write_reports(results: list[dict[str, Any]], out_dir: Path, meta: dict[str, Any],
                  name: str = "conformance") -> dict:
    """``<name>.json`` (everything) and ``<name>.md`` (tables) in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    totals = summarize(results)
    (out_dir / f"{name}.json").write_text(json.dumps(
        {"meta": meta,
         "known": [{"pattern": p, "kind": k, "reason": r} for p, k, r in catalog.KNOWN],
         "totals": totals, "results": results}, separators=(",", ":")))
    dts = meta["dtypes"]
    mode = ("TORCHPORT_SIM_STRICT=1 (device memory not host-addressable: every byte "
            "through the runtime)" if meta["strict"] else "default (host-addressable memory)")
    if meta.get("asynchronous"):
        mode += ", TORCHPORT_SIM_ASYNC=1 (kernels queued on stream workers)"
    device = meta.get("device", "sim")
    setup = f"sim memory: {mode}" if device == "sim" else f"backend: {meta.get('backend')}"
    lines = [f"# torchport conformance: {device} vs CPU over PyTorch's OpInfo database", "",
             f"Command: `{meta['command']}`  ", f"PyTorch {meta['torch']}, {setup}, "
             f"dtypes: {', '.join(dts)}, max samples per OpInfo and dtype: "
             f"{meta['max_samples']}, wall time: {meta['seconds']:.0f}s"
             + ("" if meta.get("complete", True) else
                f" -- PARTIAL: {len(results)} of {meta['opinfos_selected']} OpInfos so far"), "",
             *([f"Code: {meta['code']}", ""] if meta.get("code") else []),
             f"Each sample runs on the CPU and on `{device}`; outputs (and inputs the op mutated) "
             "are compared with `torch.testing.assert_close` (PyTorch's per-dtype "
             "tolerances); gradients for float32/float64 when the OpInfo supports autograd. "
             "Random and `empty*` ops are compared by structure, shape, dtype and device, "
             "random samples of the ops in `PROPERTIES` (dropout) by their properties "
             "(*Property checks*). "
             "**known** = a failure with a known cause (a limitation of the backend or a "
             "legitimate numerical difference; see *Known failures*): counted apart, never "
             "as a pass. A skip always gives its reason.", "",
             "## Totals", "",
             "| | pass | known | fail | skip | pass rate |", "|---|---:|---:|---:|---:|---:|"]

    def row(label: str, d: dict[str, Any], rate: float | None = None) -> str:
        if rate is None:
            ran = d["pass"] + d["known"] + d["fail"]
            rate = d["pass"] / ran if ran else None
        pr = "-" if rate is None else f"{100 * rate:.1f}%"
        return (f"| {label} | {d['pass']} | {d['known']} | {d['fail']} | {d['skip']} "
                f"| {pr} |")
    lines.append(row("OpInfos", totals["opinfos"], totals["opinfo_pass_rate"]))
    lines.append(row("forward (OpInfo, dtype), all dtypes", totals["dtypes_all"]))
    for dt in dts:
        if dt in totals["dtypes"]:
            lines.append(row(f"forward {dt}", totals["dtypes"][dt]))
    if totals["grad"]:
        lines.append(row("gradient (OpInfo, dtype), all", totals["grad_all"]))
        for dt, d in sorted(totals["grad"].items()):
            lines.append(row(f"gradient {dt}", d))
    s = totals["samples"]
    lines += ["", f"Samples: {s['passed']} passed, {s['failed']} failed (known failures "
              f"included), {s['skipped']} skipped (the CPU itself raises, or nothing "
              "to differentiate).", "",
              "Overloads seen on the device, by their most frequent path: "
              + ", ".join(f"{k} {v}" for k, v in totals["paths"].items()), ""]
    core = totals["core"]
    lines += ["## Core ATen ops by path", "",
              f"PyTorch tags {core['overloads']} overloads `torch.Tag.core`; "
              f"{len(core['above_backend'])} decompose above the backend "
              f"(CompositeImplicitAutograd: {', '.join(core['above_backend'])}), "
              f"{core['with_backend_slot']} reach it. Every path a core overload took "
              "in this run (an overload counts once per path):", "",
              "| path | core overloads | which |", "|---|---:|---|"]
    for p in ("native", "view", "decomposed", "fallback"):
        names = sorted(core["by_path"].get(p, []))
        which = ", ".join(names) or "none"
        lines.append(f"| {p} | {len(names)} | {_md(which, None)} |")
    lines += ["", f"Core overloads with a backend slot that no sample reached: "
              f"{len(core['not_exercised'])}"
              + (f" ({', '.join(core['not_exercised'])})" if core["not_exercised"] else "")
              + (". `tests/test_sim_core_opset.py` checks that every one is a native sim "
                 "kernel or a torchport core kernel." if device == "sim" else "."), ""]
    fails, knowns = [], []
    for r in results:
        if r.get("error"):
            k = r.get("error_known")
            (knowns if k and k["kind"] != "bug" else fails).append(
                (r["id"], "(whole OpInfo)", r["error"], k))
        for kind in ("dtypes", "grad"):
            for dt, v in r[kind].items():
                label = dt if kind == "dtypes" else f"{dt} (grad)"
                err = f"{v.get('failed', 0)}/{v.get('samples', 0)} samples: " \
                    + "; ".join(v.get("errors", []))
                if v["status"] == "fail":
                    fails.append((r["id"], label, err, v.get("known")))
                elif v["status"] == "known":
                    knowns.append((r["id"], label, err, v.get("known")))
    lines += ["## Failures", ""]
    if not fails:
        lines.append("None.")
    else:
        lines += ["Every failure with its diagnosis where one is known "
                  "(`KNOWN` in `torchport/tools/conformance/catalog.py`).", "",
                  "| OpInfo | dtype | diagnosis | error |", "|---|---|---|---|"]
        for oid, label, err, k in fails:
            lines.append(f"| {oid} | {label} | {_md(k['reason']) if k else 'not diagnosed'} "
                         f"| {_md(err)} |")
    lines += ["", "## Known failures", ""]
    if not knowns:
        lines.append("None.")
    else:
        lines += ["| OpInfo | dtype | kind | reason | error |", "|---|---|---|---|---|"]
        for oid, label, err, k in knowns:
            lines.append(f"| {oid} | {label} | {k['kind']} | {_md(k['reason'])} "
                         f"| {_md(err)} |")
    checked = [(pattern, kind, what) for pattern, kind, what in catalog.PROPERTIES
               if any(re.fullmatch(pattern, r["id"]) for r in results)]
    if checked:
        lines += ["", "## Property checks", "",
                  "Random samples of these OpInfos are checked by what their results must "
                  "satisfy, not by equality with the CPU's draws (`PROPERTIES` in "
                  "`torchport/tools/conformance/catalog.py`); a sample that breaks one fails.", "",
                  "| OpInfos (regex) | checks |", "|---|---|"]
        lines += [f"| `{pattern}` | {_md(what, None)} |" for pattern, _, what in checked]
    lines += ["", "## Per OpInfo", "",
              "Cells: status and passed/run samples. Paths: how many overloads took each "
              "path (most frequent path per overload).", "",
              "| OpInfo | status | " + " | ".join(dts) + " | grad | paths |",
              "|---|---|" + "---|" * len(dts) + "---|---|"]
    for r in results:
        cells = [_cell(r["dtypes"].get(dt)) for dt in dts]
        grad = " ".join(f"{dt}:{_cell(v)}" for dt, v in r["grad"].items()) or "-"
        counts: dict[str, int] = {}
        for p in r.get("paths", {}).values():
            counts[p] = counts.get(p, 0) + 1
        paths = " ".join(f"{k}:{v}" for k, v in sorted(counts.items())) or "-"
        lines.append(f"| {r['id']} | {r['status']} | " + " | ".join(cells)
                     + f" | {grad} | {paths} |")
    lines += ["", "## Path per overload", "",
              "Every ATen overload that reached the device, with its calls per path "
              "(summed over the OpInfos); core overloads in bold.", "",
              "| overload | native | view | decomposed | fallback |", "|---|---:|---:|---:|---:|"]
    core_names = {n for ns in core["by_path"].values() for n in ns}
    for n, c in totals["overload_path_calls"].items():
        label = f"**{n}**" if n in core_names else n
        lines.append(f"| {label} | " + " | ".join(str(c.get(p, "")) for p in
                                                  ("native", "view", "decomposed", "fallback"))
                     + " |")
    skips: dict[str, int] = {}
    sample_skips: dict[str, int] = {}
    for r in results:
        for kind in ("dtypes", "grad"):
            for v in r[kind].values():
                if v["status"] == "skip":
                    reason = _reason(v.get("reason", "?"))
                    skips[reason] = skips.get(reason, 0) + 1
                else:
                    for m in v.get("skip_reasons", []):
                        reason = _reason(m)
                        sample_skips[reason] = sample_skips.get(reason, 0) + 1
    lines += ["", "## Skip reasons", "", "Whole (OpInfo, dtype) entries skipped:", "",
              "| reason | count |", "|---|---:|"]
    for reason, n in sorted(skips.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {_md(reason)} | {n} |")
    lines += ["", "Single samples skipped inside entries that ran (count of entries):", "",
              "| reason | entries |", "|---|---:|"]
    for reason, n in sorted(sample_skips.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {_md(reason)} | {n} |")
    (out_dir / f"{name}.md").write_text("\n".join(lines) + "\n")
    return totals


def _reason(text: str) -> str:
    """A skip reason, grouped: numbers and long exception texts shortened."""
    text = re.sub(r"\d+", "N", text)
    return text[:140].strip()


def _cell(v: dict[str, Any] | None) -> str:
    if v is None:
        return "-"
    if v["status"] == "skip":
        return "skip"
    return f"{v['status']} {v.get('passed', 0)}/{v.get('samples', 0)}"


def _md(text: str, limit: int | None = 300) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:limit]
