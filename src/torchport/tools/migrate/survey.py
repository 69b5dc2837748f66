"""What the rewriter knows of a module before it rewrites it (the survey pass: integer
attributes, names bound to devices), and the argument rules it applies to calls."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import libcst as cst

from torchport.tools.migrate.cst_util import _code, _dotted
from torchport.tools.migrate.device_strings import (
    _device_keyword,
    _string_body,
    rewrite_device_expr,
)
from torchport.tools.migrate.model import Backend


def _rule(kind: str) -> str:
    return "collective" if kind == "backend" else "device-string"


class _ArgRule(NamedTuple):
    """How one call argument is rewritten: ``kind`` is "device", "backend", "any" (a device
    or collective string in practice, ``strict``) or "prefix" (``.startswith("cuda")``)."""

    kind: str
    containers: bool = False
    strict: bool = False


def _combine(kinds: Sequence[str | None]) -> str | None:
    """All ints: "int"; all known not None: "value"; else unknown."""
    if None in kinds or not kinds:
        return None
    return "int" if set(kinds) == {"int"} else "value"


_LEFT_DEVICE = ("a CUDA device string where no device is known to go (a log message, "
                "a dict key, an argument of an unknown function): left unchanged; use the "
                "backend's name if it names the device")


def _is_none(node: cst.CSTNode | None) -> bool:
    return isinstance(node, cst.Name) and node.value == "None"


def _is_main_guard(stmt: cst.CSTNode) -> bool:
    """``if __name__ == "__main__":`` (either operand order)."""
    if not isinstance(stmt, cst.If) or not isinstance(stmt.test, cst.Comparison):
        return False
    test = stmt.test
    if len(test.comparisons) != 1 or not isinstance(test.comparisons[0].operator, cst.Equal):
        return False
    operands = [test.left, test.comparisons[0].comparator]
    names = [o.value for o in operands if isinstance(o, cst.Name)]
    texts = [_string_body(o) for o in operands if isinstance(o, cst.SimpleString)]
    return names == ["__name__"] and texts == ["__main__"]


def _not_none_names(test: cst.BaseExpression) -> set[str]:
    """Expressions an ``if`` test proves are not ``None`` in its body."""
    if isinstance(test, cst.Comparison) and len(test.comparisons) == 1:
        target = test.comparisons[0]
        if isinstance(target.operator, cst.IsNot) and _is_none(target.comparator):
            return {_code(test.left)}
        return set()
    if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.And):
        return _not_none_names(test.left) | _not_none_names(test.right)
    if isinstance(test, (cst.Name, cst.Attribute)) and not _is_none(test):
        return {_code(test)}
    return set()


_STRICT_PROBE = Backend()


def _is_strict_device(node: cst.BaseExpression) -> bool:
    """Whether ``node`` is, or has an arm that is, a device string in practice."""
    return rewrite_device_expr(node, _STRICT_PROBE, containers=True, strict=True) is not None


@dataclass
class _Survey:
    """What a first look at the whole module tells the rewriting pass.

    ``device_names``: spellings (``dev``, ``args.accel``) that are assigned a device
    string or used as a device, so that ``dev == "cuda"`` is a device comparison;
    ``device_attrs``: argparse destinations defaulting to a device string;
    ``int_attrs``: argparse destinations that are always ints (``type=int``, int default);
    ``bindings``: the value (and annotation) bound to each assigned ``Name`` node,
    to tell what a ``.cuda(x)`` argument holds; ``entry_point``: the module runs as a
    script (``if __name__ == "__main__":``).
    """

    device_names: set[str] = field(default_factory=set)
    device_attrs: set[str] = field(default_factory=set)
    int_attrs: set[str] = field(default_factory=set)
    bindings: dict[int, tuple[cst.BaseExpression | None, cst.Annotation | None]] = field(
        default_factory=dict)
    entry_point: bool = False


class _SurveyVisitor(cst.CSTVisitor):
    def __init__(self) -> None:
        super().__init__()
        self.survey = _Survey()

    def visit_Module(self, node: cst.Module) -> None:
        self.survey.entry_point = any(_is_main_guard(stmt) for stmt in node.body)

    def _bind(self, target: cst.BaseExpression, value: cst.BaseExpression | None,
              annotation: cst.Annotation | None = None) -> None:
        if isinstance(target, cst.Name):
            self.survey.bindings[id(target)] = (value, annotation)
        elif (isinstance(target, (cst.Tuple, cst.List)) and isinstance(value, (cst.Tuple, cst.List))
              and len(target.elements) == len(value.elements)):
            for t, v in zip(target.elements, value.elements, strict=True):
                if not isinstance(t, cst.StarredElement) and not isinstance(v, cst.StarredElement):
                    self._bind(t.value, v.value)
        if value is not None and _is_strict_device(value):
            self.survey.device_names.add(_code(target))

    def visit_Assign(self, node: cst.Assign) -> None:
        for target in node.targets:
            self._bind(target.target, node.value)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        self._bind(node.target, node.value, node.annotation)

    def _device_use(self, value: cst.BaseExpression) -> None:
        if isinstance(value, (cst.Name, cst.Attribute, cst.Subscript)):
            self.survey.device_names.add(_code(value))

    def visit_Call(self, node: cst.Call) -> None:
        func = node.func
        dotted = _dotted(func) or ""
        method = func.attr.value if isinstance(func, cst.Attribute) else None
        positional = [a for a in node.args if a.keyword is None and not a.star]
        if positional and (method in {"to", "cuda"} or dotted.endswith("device")):
            self._device_use(positional[0].value)
        for arg in node.args:
            if arg.keyword is not None and _device_keyword(arg.keyword.value):
                self._device_use(arg.value)
        if method == "add_argument":
            self._argparse_option(node, positional)

    def _argparse_option(self, node: cst.Call, positional: list[cst.Arg]) -> None:
        options = [_string_body(a.value) or "" for a in positional
                   if isinstance(a.value, cst.SimpleString)]
        keywords = {a.keyword.value: a.value for a in node.args if a.keyword is not None}
        dest = next((o for o in options if o.startswith("--")), options[0] if options else "")
        dest_keyword = keywords.get("dest")
        if isinstance(dest_keyword, cst.SimpleString):
            dest = _string_body(dest_keyword) or dest
        dest = dest.lstrip("-").replace("-", "_")
        if not dest:
            return
        default = keywords.get("default")
        if default is not None and _is_strict_device(default):
            self.survey.device_attrs.add(dest)
        kind = keywords.get("type")
        if (isinstance(kind, cst.Name) and kind.value == "int" and isinstance(default, cst.Integer)
                and "nargs" not in keywords):
            self.survey.int_attrs.add(dest)
