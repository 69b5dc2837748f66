"""What the compiled-graph run knows and reports: the classes of a result, the diagnosed
differences (``KNOWN``), each OpInfo's class from its samples, and the markdown and JSON
report (:mod:`torchport.tools.conformance.compiled` runs the samples)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from torchport.tools.conformance import opinfo
from torchport.tools.conformance.opinfo import _md

CLASSES = ("equal", "close", "both-error", "MISMATCH", "skip")
_RANK = {"skip": 0, "equal": 1, "both-error": 2, "close": 3, "MISMATCH": 4}

# Differences with a diagnosed cause: (regex over "<OpInfo id>/<dtype>", diagnosis), for
# MISMATCH and close entries. A mismatch stays MISMATCH in the counts; the report gives
# the diagnosis and the exit status ignores it. A cause that torchport can fix does not
# belong here: it gets fixed. Paths are of torch 2.13's sources.
KNOWN: list[tuple[str, str]] = [
    (r"(native_batch_norm|_native_batch_norm_legit)(\..*)?/.*",
     "eval-mode batch norm's saved mean and invstd: inductor's decomposition returns the "
     "running statistics ([C]) on every device but the CPU and empty tensors ([0]) on the CPU "
     "(torch/_decomp/decompositions.py:2130, `if input.device.type != \"cpu\"`, after the "
     "shapes CUDA's kernel returns); the compiled sim gives CUDA's shapes, the first output "
     "is equal"),
    (r"nn\.functional\.conv.*/.*",
     "a convolution with bias: on every device but the CPU inductor lowers it as the "
     "convolution without bias and a fused add of the bias "
     "(torch/_inductor/kernel/conv.py:553, `if bias is not None and device_type != \"cpu\"`); "
     "the CPU's kernel adds the bias in its own loop: the sums round differently"),
    (r"(native_group_norm|nn\.functional\.group_norm)/.*",
     "group norm's decomposition folds the normalization into a per-channel scale and shift "
     "(x * w + b, as the CPU kernel does) on the CPU only, elsewhere (x - mean) * rstd * "
     "weight + bias (torch/_refs/__init__.py:3392, `if input.device.type == \"cpu\"`; "
     "inductor decomposes aten.native_group_norm with it, torch/_inductor/decomposition.py:91)"),
]


def known_cause(key: str) -> str | None:
    """The diagnosis of a mismatch ``"<OpInfo id>/<dtype>"``, if known."""
    for pattern, reason in KNOWN:
        if re.fullmatch(pattern, key):
            return reason
    return None


def _eager_cause(key: str) -> str | None:
    """The eager run's diagnosis of the same failure (the op fails on the device without
    compiling too: a limitation of the op layer, not of the compiled program)."""
    cause = opinfo.known_cause(key)
    if cause is None or cause[0] == "bug":
        return None
    return f"eager mode fails alike ({cause[0]}, opinfo.KNOWN): {cause[1]}"


def classify(r: dict[str, Any]) -> dict[str, Any]:
    """Each (OpInfo, dtype) gets its worst sample's class; mismatches their diagnosis."""
    for dt, v in r["dtypes"].items():
        if "skip" in v:
            v["class"] = "skip"
            continue
        ran = [s for s in v["samples"] if s["class"] != "skip"]
        v["class"] = max((s["class"] for s in ran), key=_RANK.__getitem__, default="skip")
        if v["class"] == "skip":
            v["skip"] = v["samples"][0]["detail"] if v["samples"] else "no samples"
        if v["class"] in ("MISMATCH", "close"):
            cause = known_cause(f"{r['id']}/{dt}") or (
                _eager_cause(f"{r['id']}/{dt}") if v["class"] == "MISMATCH" else None)
            if cause:
                v["known"] = cause
    if r.get("error"):
        r["class"] = "MISMATCH"
        cause = known_cause(f"{r['id']}/error")
        if cause:
            r["known"] = cause
    else:
        r["class"] = max((v["class"] for v in r["dtypes"].values()), key=_RANK.__getitem__,
                         default="skip")
    return r


def mismatches(results: list[dict[str, Any]], diagnosed: bool = True
               ) -> list[tuple[str, str, dict[str, Any]]]:
    """(OpInfo id, dtype or ``"error"``, entry) of every mismatch; ``diagnosed=False``
    leaves out those with a known cause."""
    found = []
    for r in results:
        if r.get("error") and (diagnosed or not r.get("known")):
            found.append((r["id"], "error", {"detail": r["error"], "known": r.get("known")}))
        for dt, v in r["dtypes"].items():
            if v["class"] == "MISMATCH" and (diagnosed or not v.get("known")):
                found.append((r["id"], dt, v))
    return found


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts per class: OpInfos, (OpInfo, dtype) entries, samples; and compiled samples."""
    tot: dict[str, Any] = {k: dict.fromkeys(CLASSES, 0) for k in ("opinfos", "entries",
                                                                   "samples")}
    tot["compiled_samples"] = tot["eager_samples"] = tot["not_run"] = 0
    for r in results:
        if r.get("not_run"):
            tot["not_run"] += 1
            continue
        tot["opinfos"][r["class"]] += 1
        for v in r["dtypes"].values():
            tot["entries"][v["class"]] += 1
            for s in v.get("samples", []):
                tot["samples"][s["class"]] += 1
                if s["class"] != "skip":
                    key = "compiled_samples" if s.get("graphs") else "eager_samples"
                    tot[key] += 1
    tot["mismatches"] = len(mismatches(results))
    tot["undiagnosed"] = len(mismatches(results, diagnosed=False))
    return tot


def write_report(results: list[dict[str, Any]], out: Path, meta: dict[str, Any]
                 ) -> dict[str, Any]:
    """``out`` (markdown) and the same name with ``.json`` (everything)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tot = summarize(results)
    out.with_suffix(".json").write_text(json.dumps(
        {"meta": meta, "known": [{"pattern": p, "reason": r} for p, r in KNOWN],
         "totals": tot, "results": results}, separators=(",", ":")))
    dev = meta["device"]
    ran = len(results) - tot["not_run"]
    lines = [f"# torch.compile on {dev} vs torch.compile on the CPU, over PyTorch's OpInfos", "",
             f"Command: `{meta['command']}`  ",
             f"PyTorch {meta['torch']}, sim memory: {meta['mode']}, dtypes: "
             f"{', '.join(meta['dtypes'])}, samples per OpInfo and dtype: "
             f"{meta['max_samples']}, OpInfos: {meta['ops'] or 'all of op_db'} "
             f"({meta['opinfos_selected']} selected, {ran} run"
             + (f", {tot['not_run']} not started within the time budget of "
                f"{meta['budget']:.0f}s" if tot["not_run"] else "")
             + f"), wall time {meta['seconds']:.0f}s"
             + ("" if meta.get("complete", True) else " -- PARTIAL, still running"), "",
             f"Each sample runs through `torch.compile(lambda *a, **k: op(*a, **k), "
             f"fullgraph=False, dynamic=False)` on CPU inputs and on the same inputs on `{dev}`. "
             "**equal**: bit for bit (NaN positions and signed zeros included), same dtype, "
             f"shape, strides, result on `{dev}`. **close**: within `torch.testing.assert_close`"
             "'s default tolerances. **both-error**: both raise the same exception type. "
             "**MISMATCH**: anything else (beyond tolerance; dtype, shape, strides, device; "
             "one side raises). An (OpInfo, dtype) gets its worst sample's class, an OpInfo its "
             "worst dtype's. Random ops and `empty*` are skipped. "
             f"`{dev}` compiles the same C++ as the CPU (`torchport/graph/cpu_checks.py`), so "
             "**equal** is the expectation; a sample whose graphs break runs those parts "
             "eagerly on both sides.", "",
             "## Totals", "", "| | " + " | ".join(CLASSES) + " |",
             "|---|" + "---:|" * len(CLASSES)]
    for label, key in (("OpInfos", "opinfos"), ("(OpInfo, dtype)", "entries"),
                       ("samples", "samples")):
        lines.append(f"| {label} | " + " | ".join(str(tot[key][c]) for c in CLASSES) + " |")
    lines += ["", f"Samples compared: {tot['compiled_samples']} with at least one graph "
              f"inductor compiled for `{dev}`, {tot['eager_samples']} with none (dynamo "
              "found nothing to compile, or only graph breaks). Mismatches: "
              f"{tot['mismatches']}, undiagnosed: {tot['undiagnosed']}.", "",
              "## Mismatches", ""]
    found = mismatches(results)
    if not found:
        lines.append("None.")
    else:
        lines += ["| OpInfo | dtype | max abs | max rel | first mismatching sample | diagnosis |",
                  "|---|---|---:|---:|---|---|"]
        for oid, dt, v in found:
            worst = next((s for s in v.get("samples", []) if s["class"] == "MISMATCH"), v)
            a, rel = worst.get("abs"), worst.get("rel")
            lines.append(f"| {oid} | {dt} | {'-' if a is None else f'{a:.3g}'} "
                         f"| {'-' if rel is None else f'{rel:.3g}'} "
                         f"| {_md(worst.get('detail') or '')} "
                         f"| {_md(v.get('known') or 'NOT DIAGNOSED', None)} |")
    closes = [(r["id"], dt, v, s) for r in results for dt, v in r["dtypes"].items()
              for s in v.get("samples", []) if s["class"] == "close"]
    lines += ["", "## Close, not equal", "", "Within tolerance, so not failures; each with "
              "the reason the two programs compute differently where it is known.", ""]
    if not closes:
        lines.append("None.")
    else:
        lines += ["| OpInfo | dtype | max abs | max rel | detail | diagnosis |",
                  "|---|---|---:|---:|---|---|"]
        for oid, dt, v, s in closes:
            lines.append(f"| {oid} | {dt} | {s.get('abs', 0):.3g} | {s.get('rel', 0):.3g} "
                         f"| {_md(s.get('detail') or '')} "
                         f"| {_md(v.get('known') or 'not diagnosed', None)} |")
    skips: dict[str, int] = {}
    for r in results:
        if r.get("not_run"):
            continue
        for v in r["dtypes"].values():
            reasons = [v["skip"]] if v["class"] == "skip" else [
                s["detail"] for s in v.get("samples", []) if s["class"] == "skip"]
            for m in dict.fromkeys(reasons):
                k = re.sub(r"\d+", "N", m)[:140]
                skips[k] = skips.get(k, 0) + 1
    lines += ["", "## Skip reasons", "", "(OpInfo, dtype) entries with a skipped sample:", "",
              "| reason | entries |", "|---|---:|"]
    for reason, n in sorted(skips.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {_md(reason)} | {n} |")
    lines += ["", "## Per OpInfo", "", "Cells: class and samples per class; `g`: samples "
              f"that compiled at least one graph for `{dev}`.", "",
              "| OpInfo | class | " + " | ".join(meta["dtypes"]) + " | seconds |",
              "|---|---|" + "---|" * len(meta["dtypes"]) + "---:|"]
    for r in results:
        if r.get("not_run"):
            continue
        cells = []
        for dt in meta["dtypes"]:
            v = r["dtypes"].get(dt)
            if v is None:
                cells.append("-")
            elif v["class"] == "skip":
                cells.append("skip")
            else:
                counts: dict[str, int] = {}
                for s in v["samples"]:
                    counts[s["class"]] = counts.get(s["class"], 0) + 1
                g = sum(1 for s in v["samples"] if s.get("graphs"))
                cells.append(" ".join(f"{c}:{n}" for c, n in counts.items()) + f" g:{g}")
        lines.append(f"| {r['id']} | {r['class']} | " + " | ".join(cells)
                     + f" | {r.get('seconds', 0):.1f} |")
    out.write_text("\n".join(lines) + "\n")
    return tot
