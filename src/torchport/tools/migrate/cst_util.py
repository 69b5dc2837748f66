"""The small libcst helpers the migration rules share: node text, dotted names, keyword
arguments and re-commaed argument lists, the patterns of device strings."""

from __future__ import annotations

import re
from collections.abc import Sequence

import libcst as cst

_EMPTY = cst.Module(body=[])
_NO_SPACE = cst.SimpleWhitespace("")
_DEVICE_RE = re.compile(r"cuda(:\d+)?")
# "cuda:%d", "cuda:{}", "cuda:" ... used with %, .format() or +.
_DEVICE_TEMPLATE_RE = re.compile(r"cuda(:(\d*|%[dis]|\{[^{}]*\}))?")
# The same with the colon required: what a template must look like outside device positions.
_STRICT_TEMPLATE_RE = re.compile(r"cuda:(\d*|%[dis]|\{[^{}]*\})")
# "cpu:gloo,cuda:nccl": a collective spec naming NCCL.
# Device types a list of devices may mix with "cuda" (("cuda", "mps", "cpu")).
_DEVICE_TYPE_RE = re.compile(r"(cpu|cuda|mps|xpu|meta|hpu|mtia|xla|ipu|privateuseone)(:\d+)?")
_COLLECTIVE_SPEC_RE = re.compile(r"([a-z]+:[a-z]+,)*[a-z]+:[a-z]+")


def _code(node: cst.CSTNode) -> str:
    if isinstance(node, cst.Arg):
        node = node.with_changes(comma=cst.MaybeSentinel.DEFAULT)
    return _EMPTY.code_for_node(node).strip()


def _eq() -> cst.AssignEqual:
    return cst.AssignEqual(whitespace_before=_NO_SPACE, whitespace_after=_NO_SPACE)


def _dotted(node: cst.CSTNode | None) -> str | None:
    """``a.b.c`` for a Name/Attribute chain, else ``None``."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr.value}"
    return None


def _dotted_node(dotted: str) -> cst.Attribute | cst.Name:
    parts = dotted.split(".")
    node: cst.Attribute | cst.Name = cst.Name(parts[0])
    for part in parts[1:]:
        node = cst.Attribute(value=node, attr=cst.Name(part))
    return node


def _root_name(node: cst.BaseExpression) -> cst.Name | None:
    while isinstance(node, cst.Attribute):
        node = node.value
    return node if isinstance(node, cst.Name) else None


# --------------------------------------------------------------------------- arg lists


def _layout(args: Sequence[cst.Arg], trailing: cst.Comma | cst.MaybeSentinel) -> list[cst.Arg]:
    """Re-comma an argument list: ``", "`` between args, ``trailing`` after the last."""
    out = []
    for index, arg in enumerate(args):
        if index == len(args) - 1:
            arg = arg.with_changes(comma=trailing)
        elif isinstance(arg.comma, cst.MaybeSentinel):
            arg = arg.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
        out.append(arg)
    return out


def _trailing(args: Sequence[cst.Arg]) -> cst.Comma | cst.MaybeSentinel:
    return args[-1].comma if args else cst.MaybeSentinel.DEFAULT


def _kwarg(name: str, value: cst.BaseExpression) -> cst.Arg:
    return cst.Arg(value=value, keyword=cst.Name(name), equal=_eq())
