"""Concrete-syntax-tree rewrite of CUDA-specific PyTorch code for a torchport backend.

Why libcst and not regular expressions: a CST keeps every comment, blank line
and quote style, and lets the rules look at *where* a string sits (argument of
``torch.device``, ``device=`` keyword, comparison with ``x.device.type``...)
so that ``"cuda"`` is only changed where it names a device.  Names are
resolved through imports (``import torch as th``, ``from torch.cuda import
synchronize``) with libcst's ``QualifiedNameProvider``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import libcst as cst
from libcst.metadata import (
    Assignment,
    MetadataWrapper,
    PositionProvider,
    QualifiedNameProvider,
    QualifiedNameSource,
    ScopeProvider,
)

from torchport.migrate.apis import (
    AMP_CALLABLES,
    CPP_EXTENSION_LOADERS,
    CUDA_AUTOCAST_POSITIONAL,
    DEVICE_CHOOSING_LIBRARIES,
    DEVICE_FIRST_ARG_CALLS,
    DEVICE_GENERIC_APIS,
    GRAD_SCALERS,
    FindingKind,
    classify_env_var,
    classify_module,
    classify_torch_api,
    is_unsupported,
)
from torchport.migrate.model import Backend, Change, Finding

__all__ = [
    "SourceResult",
    "backend_import_line",
    "migrate_source",
    "rewrite_collective_expr",
    "rewrite_device_expr",
    "rewrite_source",
]

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


# --------------------------------------------------------------------------- strings


def _string_body(node: cst.SimpleString) -> str | None:
    """The raw text between the quotes of a non-bytes literal."""
    if "b" in node.prefix.lower():
        return None
    start = len(node.prefix) + len(node.quote)
    return node.value[start : len(node.value) - len(node.quote)]


def _with_body(node: cst.SimpleString, body: str) -> cst.SimpleString:
    return node.with_changes(value=f"{node.prefix}{node.quote}{body}{node.quote}")


def _device_text(text: str, backend: Backend) -> str | None:
    match = _DEVICE_RE.fullmatch(text)
    return None if match is None else backend.name + (match.group(1) or "")


def _collective_text(text: str, backend: Backend) -> str | None:
    """``"nccl"`` -> ``"simccl"``; also ``"cpu:gloo,cuda:nccl"`` style specs."""
    if text == "nccl":
        return backend.collective
    if ":" not in text:
        return None
    parts = []
    for part in text.split(","):
        dev, sep, lib = part.partition(":")
        if sep:
            dev = backend.name if dev.strip() == "cuda" else dev
            lib = backend.collective if lib.strip() == "nccl" else lib
        parts.append(dev + sep + lib)
    new = ",".join(parts)
    return None if new == text else new


def _rewrite_template(node: cst.BaseExpression, backend: Backend,
                      strict: bool = False) -> cst.BaseExpression | None:
    if isinstance(node, cst.SimpleString):
        body = _string_body(node)
        pattern = _STRICT_TEMPLATE_RE if strict else _DEVICE_TEMPLATE_RE
        if body is not None and pattern.fullmatch(body):
            return _with_body(node, backend.name + body[4:])
    return None


Rewrite = Callable[[cst.BaseExpression], "cst.BaseExpression | None"]


def _rewrite_arms(node: cst.BaseExpression, rewrite: Rewrite) -> cst.BaseExpression | None:
    """Both arms of ``a if c else b`` / ``a or b``; ``None`` when neither changed."""
    fields = ("body", "orelse") if isinstance(node, cst.IfExp) else ("left", "right")
    new = {f: rewrite(getattr(node, f)) for f in fields}
    if all(v is None for v in new.values()):
        return None
    return node.with_changes(**{f: v or getattr(node, f) for f, v in new.items()})


def _rewrite_elements(node: cst.Tuple | cst.List | cst.Set,
                      rewrite: Rewrite) -> cst.BaseExpression | None:
    """Each element of a tuple/list/set literal; ``None`` when none changed."""
    changed = False
    items: list[cst.BaseElement] = []
    for item in node.elements:
        new_value = rewrite(item.value)
        if new_value is not None:
            changed = True
            item = item.with_changes(value=new_value)
        items.append(item)
    return node.with_changes(elements=items) if changed else None


def rewrite_device_expr(
    node: cst.BaseExpression, backend: Backend, *, containers: bool = False,
    strict: bool = False,
) -> cst.BaseExpression | None:
    """Rewrite an expression that evaluates to a device; ``None`` when nothing changed.

    Only literal parts are touched: ``"cuda:0"``, ``f"cuda:{rank}"``,
    ``"cuda:%d" % r``, ``"cuda:{}".format(r)``, ``"cuda:" + str(r)``, both arms of
    ``a if cond else b``, ``x or "cuda"``, lambda bodies and, with ``containers``,
    dict keys/values and tuple/list/set elements.

    ``strict`` is for places that are not known to take a device (any assignment,
    ``return``, a keyword of an unknown call): there only what is a device string in
    practice changes: ``"cuda"``/``"cuda:N"``, ``f"cuda:{i}"``, templates with the
    colon, and dict *values* (a key ``"cuda"`` may be looked up elsewhere).
    """
    def again(n: cst.BaseExpression, inner: bool = containers) -> cst.BaseExpression | None:
        return rewrite_device_expr(n, backend, containers=inner, strict=strict)

    if isinstance(node, cst.SimpleString):
        body = _string_body(node)
        new = None if body is None else _device_text(body, backend)
        return None if new is None else _with_body(node, new)
    if isinstance(node, cst.FormattedString):
        parts = list(node.parts)
        if not parts or not isinstance(parts[0], cst.FormattedStringText):
            return None
        text = parts[0].value
        if len(parts) == 1:
            ok = _DEVICE_RE.fullmatch(text) is not None
        else:  # strict: exactly f"cuda:{i}", not f"cuda:{i} is ready"
            ok = text == "cuda:" and (not strict or len(parts) == 2)
        if not ok:
            return None
        parts[0] = parts[0].with_changes(value=backend.name + text[4:])
        return node.with_changes(parts=parts)
    if isinstance(node, (cst.IfExp, cst.BooleanOperation)):
        return _rewrite_arms(node, again)
    if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, (cst.Add, cst.Modulo)):
        left = _rewrite_template(node.left, backend, strict)
        return None if left is None else node.with_changes(left=left)
    if (
        isinstance(node, cst.Call)
        and isinstance(node.func, cst.Attribute)
        and node.func.attr.value == "format"
    ):
        fmt = _rewrite_template(node.func.value, backend, strict)
        return None if fmt is None else node.with_changes(func=node.func.with_changes(value=fmt))
    if isinstance(node, cst.Lambda):
        body = again(node.body)
        return None if body is None else node.with_changes(body=body)
    if containers and isinstance(node, cst.Dict):
        changed = False
        elements: list[cst.BaseDictElement] = []
        for element in node.elements:
            if isinstance(element, cst.DictElement):
                key = None if strict else again(element.key, False)
                value = again(element.value, True)
                if key is not None or value is not None:
                    changed = True
                    element = element.with_changes(
                        key=key or element.key, value=value or element.value
                    )
            elements.append(element)
        return node.with_changes(elements=elements) if changed else None
    if containers and isinstance(node, (cst.Tuple, cst.List, cst.Set)):
        if strict and not _all_devices(node, backend):
            return None  # ("", "cuda", "a-b"): not a list of devices
        return _rewrite_elements(node, lambda n: again(n, False))
    return None


def _all_devices(node: cst.Tuple | cst.List | cst.Set, backend: Backend) -> bool:
    """Whether every string literal in ``node`` names a device (type)."""
    for element in node.elements:
        if isinstance(element.value, cst.SimpleString):
            body = _string_body(element.value) or ""
            if not (_DEVICE_TYPE_RE.fullmatch(body) or body.split(":")[0] == backend.name):
                return False
    return True


def rewrite_collective_expr(
    node: cst.BaseExpression, backend: Backend, *, containers: bool = False,
    strict: bool = False,
) -> cst.BaseExpression | None:
    """Rewrite an expression naming a torch.distributed backend (``"nccl"``).

    ``strict`` (places not known to take a backend) only accepts ``"nccl"`` itself and
    ``"cpu:gloo,cuda:nccl"``-style specs.
    """
    if isinstance(node, cst.SimpleString):
        body = _string_body(node)
        if body is None or (strict and not _is_collective_text(body)):
            return None
        new = _collective_text(body, backend)
        return None if new is None else _with_body(node, new)
    if isinstance(node, (cst.IfExp, cst.BooleanOperation)):
        return _rewrite_arms(
            node, lambda n: rewrite_collective_expr(n, backend, strict=strict))
    if containers and isinstance(node, (cst.Tuple, cst.List, cst.Set)):
        return _rewrite_elements(
            node, lambda n: rewrite_collective_expr(n, backend, strict=strict))
    return None


def _is_collective_text(text: str) -> bool:
    return text == "nccl" or (
        _COLLECTIVE_SPEC_RE.fullmatch(text) is not None and ":nccl" in text)


def _is_device_text(text: str) -> bool:
    return _DEVICE_RE.fullmatch(text) is not None


def _hint(text: str) -> str | None:
    """Which kind of string a name suggests: ``device`` or ``backend`` (collective)."""
    lowered = text.lower()
    if "device" in lowered:
        return "device"
    if "backend" in lowered:
        return "backend"
    return None


def _device_keyword(keyword: str) -> bool:
    return keyword in {"map_location", "device_type"} or keyword.endswith("device")


def _strings_in(node: cst.CSTNode) -> Iterator[str]:
    if isinstance(node, cst.SimpleString):
        body = _string_body(node)
        if body is not None:
            yield body
    for child in node.children:
        yield from _strings_in(child)


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


# --------------------------------------------------------------------------- transformer


@dataclass
class SourceResult:
    """Outcome of rewriting one module."""

    code: str | bytes
    changes: list[Change] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.changes)


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


class _Rewriter(cst.CSTTransformer):
    """Applies every rule in one pass; records changes and findings as it goes."""

    METADATA_DEPENDENCIES = (PositionProvider, QualifiedNameProvider, ScopeProvider)

    def __init__(self, backend: Backend, path: str, survey: _Survey | None = None) -> None:
        super().__init__()
        self.backend = backend
        self.path = path
        self.survey = survey or _Survey()
        self._arg_rules: dict[int, list[_ArgRule | None]] = {}  # per Call, from visit_Call
        self._device_arg_ids: set[int] = set()  # argument values in device positions
        self._in_device_arg = 0  # inside one: the enclosing rule rewrites the whole value
        self._guards: list[set[str]] = []  # names proven not None by enclosing `if`s
        # CUDA-looking strings seen, by the id of the node passed up: the ones still in the
        # final tree were not rewritten and are reported.
        self._leftovers: dict[int, tuple[cst.CSTNode, int, int, FindingKind, str, str]] = {}
        self._cuda_sources: list[tuple[cst.CSTNode, str]] = []  # "kernel.cu" literals
        # torch.accelerator & co. pick the backend at run time: it must be imported
        self.uses_accelerator = False
        self.imports_torch = False
        # libraries choosing their device (DEVICE_CHOOSING_LIBRARIES) imported at top level
        self.device_libraries: list[str] = []
        self.changes: list[Change] = []
        self.findings: list[Finding] = []
        self._finding_keys: set[tuple[int, int, str]] = set()
        self._value_ids: set[int] = set()  # nodes that are the .value of an Attribute
        self._attr_ids: set[int] = set()  # Name nodes in attribute position (x.<attr>)
        self._called_ids: set[int] = set()  # Call.func and Decorator.decorator nodes
        self._keep_ids: set[int] = set()  # chain parts that must not be renamed
        self._no_collapse_ids: set[int] = set()  # `.amp` nodes that stay on the mirror
        self._collapse_ids: set[int] = set()  # `<torch>.cuda.amp` nodes -> `<torch>.amp`
        self._collapsed_cuda_ids: set[int] = set()  # their `<torch>.cuda` parts
        self._recorded_by_call: set[int] = set()  # chains whose change the Call rule records
        self._unfixable_amp_calls: set[int] = set()  # amp calls we cannot give a device
        self._import_depth = 0
        self._def_depth = 0
        self.has_backend_import = False

    def on_visit(self, node: cst.CSTNode) -> bool:
        if id(node) in self._device_arg_ids:
            self._in_device_arg += 1
        return super().on_visit(node)

    def on_leave(
        self, original_node: cst.CSTNode, updated_node: cst.CSTNode
    ) -> cst.CSTNode | cst.RemovalSentinel | cst.FlattenSentinel[cst.CSTNode]:
        result = super().on_leave(original_node, updated_node)
        if id(original_node) in self._device_arg_ids:
            self._in_device_arg -= 1
        return result

    # ----------------------------------------------------------------- helpers

    def _pos(self, node: cst.CSTNode) -> tuple[int, int]:
        start = self.get_metadata(PositionProvider, node).start
        return start.line, start.column + 1

    def _qname(self, node: cst.CSTNode) -> str | None:
        """Import-resolved dotted name of ``node`` (torch names preferred).

        Only plain ``a.b.c`` chains have one: ``f(x).cuda`` does not.
        """
        if _dotted(node) is None:
            return None
        metas = self.get_metadata(QualifiedNameProvider, node, None)
        if metas:
            names = sorted(q.name for q in metas if q.source is QualifiedNameSource.IMPORT)
            torch_names = [n for n in names if n == "torch" or n.startswith("torch.")]
            return (torch_names or names or [None])[0]
        # Unresolved (torch bound in an unusual way, or a snippet): trust the spelling.
        dotted = _dotted(node)
        if dotted is not None and (dotted == "torch" or dotted.startswith("torch.")):
            return dotted
        return None

    def _change(
        self, node: cst.CSTNode, rule: str, before: str, after: str, note: str = ""
    ) -> None:
        line, column = self._pos(node)
        self.changes.append(Change(self.path, line, column, rule, before, after, note))

    def _change_nodes(
        self, original: cst.CSTNode, updated: cst.CSTNode, rule: str, note: str = ""
    ) -> None:
        self._change(original, rule, _code(original), _code(updated), note)

    def _finding(self, node: cst.CSTNode, kind: FindingKind, api: str, reason: str) -> None:
        line, column = self._pos(node)
        self._add_finding(line, column, kind, api, reason)

    def _add_finding(self, line: int, column: int, kind: FindingKind, api: str,
                     reason: str) -> None:
        if (line, column, api) in self._finding_keys:
            return
        self._finding_keys.add((line, column, api))
        self.findings.append(Finding(self.path, line, column, kind, api, reason))

    def _classify(self, node: cst.CSTNode, qname: str) -> None:
        result = classify_torch_api(qname)
        if result is not None:
            self._finding(node, result[0], qname, result[1])

    @staticmethod
    def _is_amp_callable(qname: str | None) -> bool:
        return (
            qname is not None
            and qname.startswith("torch.cuda.amp.")
            and qname.rsplit(".", 1)[1] in AMP_CALLABLES
        )

    def _goes_to_torch_amp(self, expr: cst.CSTNode) -> bool:
        """Whether a ``torch.cuda.amp`` reference spelled as ``expr`` ends up under torch.amp.

        True for ``<torch>.cuda.amp...`` chains and names bound by importing from
        ``torch.cuda.amp``; False through a ``torch.cuda`` alias (``tc.amp.X``),
        which becomes the backend mirror ``torch.<name>.amp``.
        """
        root = _root_name(expr) if isinstance(expr, cst.BaseExpression) else None
        if root is None:
            return False
        root_q = self._qname(root)
        return root_q == "torch" or (root_q is not None and root_q.startswith("torch.cuda.amp"))

    # ----------------------------------------------------------------- scopes

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self._def_depth += 1

    def leave_FunctionDef(
        self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef
    ) -> cst.FunctionDef:
        self._def_depth -= 1
        return updated_node

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self._def_depth += 1
        if isinstance(node.body, cst.IndentedBlock):
            for stmt in node.body.body:
                if isinstance(stmt, cst.FunctionDef) and stmt.name.value == "cuda":
                    self._finding(stmt, "unsupported", f"{node.name.value}.cuda",
                                  "defines a .cuda() method: calls to .cuda() were rewritten "
                                  "to .to(), which does not run it")

    def visit_If_body(self, node: cst.If) -> None:
        self._guards.append(_not_none_names(node.test))

    def leave_If_body(self, node: cst.If) -> None:
        self._guards.pop()

    def leave_ClassDef(
        self, original_node: cst.ClassDef, updated_node: cst.ClassDef
    ) -> cst.ClassDef:
        self._def_depth -= 1
        return updated_node

    # ----------------------------------------------------------------- references

    def visit_Call(self, node: cst.Call) -> None:
        qname = self._qname(node.func)
        if self._is_amp_callable(qname) and self._goes_to_torch_amp(node.func):
            assert qname is not None
            if not _amp_call_fixable(node, qname):
                self._unfixable_amp_calls.add(id(node))
                if isinstance(node.func, cst.Attribute):
                    return  # not "called" for our purposes: the chain stays on the mirror
            else:
                self._recorded_by_call.add(id(node.func))
        self._called_ids.add(id(node.func))
        rules = self._rules_for(node, qname)
        self._arg_rules[id(node)] = rules
        for arg, rule in zip(node.args, rules, strict=True):
            if rule is not None and rule.kind == "device" and not rule.strict:
                self._device_arg_ids.add(id(arg.value))

    def visit_Decorator(self, node: cst.Decorator) -> None:
        self._called_ids.add(id(node.decorator))
        qname = self._qname(node.decorator)
        if self._is_amp_callable(qname) and self._goes_to_torch_amp(node.decorator):
            self._recorded_by_call.add(id(node.decorator))

    def visit_Attribute(self, node: cst.Attribute) -> None:
        # Parents are visited before children, so decisions about the inner
        # ``torch.cuda`` part are taken here and applied when it is left.
        self._value_ids.add(id(node.value))
        self._attr_ids.add(id(node.attr))
        if self._import_depth:
            return
        if id(node) in self._keep_ids:
            self._mark_chain(node, self._keep_ids)
            return
        qname = self._qname(node)
        if qname is None or not qname.startswith("torch.cuda"):
            return
        if is_unsupported(qname):
            self._mark_chain(node, self._keep_ids)
        elif self._is_amp_callable(qname) and id(node) not in self._called_ids:
            # ``ctx = torch.cuda.amp.autocast`` cannot get the device argument that
            # torch.amp needs: leave it on the backend mirror (torch.<name>.amp).
            self._mark_chain(node, self._no_collapse_ids)
        elif (
            qname == "torch.cuda.amp"
            and id(node) not in self._no_collapse_ids
            and isinstance(node.value, cst.Attribute)
            and node.value.attr.value == "cuda"
            and self._qname(node.value) == "torch.cuda"
        ):
            self._collapse_ids.add(id(node))
            self._collapsed_cuda_ids.add(id(node.value))

    @staticmethod
    def _mark_chain(node: cst.Attribute, marks: set[int]) -> None:
        inner: cst.BaseExpression = node.value
        while isinstance(inner, cst.Attribute):
            marks.add(id(inner))
            inner = inner.value

    def leave_Attribute(
        self, original_node: cst.Attribute, updated_node: cst.Attribute
    ) -> cst.BaseExpression:
        if self._import_depth:
            return updated_node
        result = updated_node
        qname = self._qname(original_node)
        node_id = id(original_node)
        if (
            qname == "torch.cuda"
            and original_node.attr.value == "cuda"
            and node_id not in self._keep_ids
            and node_id not in self._collapsed_cuda_ids
        ):
            result = updated_node.with_changes(attr=cst.Name(self.backend.name))
        elif node_id in self._collapse_ids:
            inner = updated_node.value
            assert isinstance(inner, cst.Attribute)
            result = updated_node.with_changes(value=inner.value)
        if original_node.attr.value == "is_cuda":
            result = result.with_changes(attr=cst.Name(f"is_{self.backend.name}"))
            self._change_nodes(original_node, result, "is_cuda")
        if (original_node.attr.value == "cuda" and node_id not in self._value_ids
                and node_id not in self._called_ids
                and qname is not None and qname.startswith(("torch.Tensor.", "torch.nn."))):
            self._finding(original_node, "unsupported", _code(original_node),
                          "a .cuda method used without calling it: rewrite by hand, e.g. "
                          f"lambda t: t.to({self.backend.name!r})")
        if node_id not in self._value_ids and qname is not None:
            self._reference(original_node, qname)
            if (
                qname.startswith("torch.cuda")
                and node_id not in self._recorded_by_call
                and _code(original_node) != _code(result)
            ):
                rule = "torch.cuda.amp" if qname.startswith("torch.cuda.amp") else "torch.cuda"
                self._change_nodes(original_node, result, rule)
        return result

    def leave_Name(self, original_node: cst.Name, updated_node: cst.Name) -> cst.Name:
        node_id = id(original_node)
        if self._import_depth or node_id in self._value_ids or node_id in self._attr_ids:
            return updated_node
        qname = self._qname(original_node)
        if qname is not None and qname.startswith("torch."):
            self._reference(original_node, qname)
        return updated_node

    def _reference(self, node: cst.CSTNode, qname: str) -> None:
        """Report the API named by the outermost part of a dotted chain, if notable."""
        if any(qname == api or qname.startswith(api + ".") for api in DEVICE_GENERIC_APIS):
            self.uses_accelerator = True
        if self._is_amp_callable(qname) and id(node) not in self._called_ids:
            if self._goes_to_torch_amp(node) and not isinstance(node, cst.Attribute):
                self._finding(
                    node,
                    "unsupported",
                    qname,
                    "used without calling it; torch.amp needs the device type: "
                    f"pass {self.backend.name!r} where it is finally called",
                )
            return
        self._classify(node, qname)

    def leave_SimpleString(
        self, original_node: cst.SimpleString, updated_node: cst.SimpleString
    ) -> cst.SimpleString:
        body = _string_body(original_node)
        if body is None:
            return updated_node
        env = classify_env_var(body)
        if env is not None:
            self._finding(original_node, env[0], body, env[1])
        elif body.endswith((".cu", ".cuh")) and not any(c.isspace() for c in body):
            self._cuda_sources.append((original_node, body))
        elif _is_device_text(body) or _STRICT_TEMPLATE_RE.fullmatch(body):  # "cuda:%d" too
            self._leftover(original_node, updated_node, "unsupported", _code(original_node),
                           _LEFT_DEVICE)
        elif _is_collective_text(body):
            self._leftover(original_node, updated_node, "unsupported", _code(original_node),
                           "names NCCL where no collective backend is known to go: left "
                           f"unchanged; the backend's library is {self.backend.collective!r}")
        elif body.startswith("torch.cuda.") and body[11:].isidentifier():
            self._leftover(original_node, updated_node, "unsupported", _code(original_node),
                           "names a CUDA tensor type (x.type(...)); use .to() with a dtype")
        return updated_node

    def leave_FormattedString(
        self, original_node: cst.FormattedString, updated_node: cst.FormattedString
    ) -> cst.FormattedString:
        if rewrite_device_expr(original_node, self.backend, strict=True) is not None:
            self._leftover(original_node, updated_node, "unsupported", _code(original_node),
                           _LEFT_DEVICE)
        return updated_node

    def _leftover(self, original: cst.CSTNode, updated: cst.CSTNode, kind: FindingKind,
                  api: str, reason: str) -> None:
        """Remember a CUDA string; reported at the end if no rule rewrote it."""
        line, column = self._pos(original)
        self._leftovers[id(updated)] = (updated, line, column, kind, api, reason)

    def _report_leftovers(self, module: cst.Module) -> None:
        found: list[int] = []

        class _Strings(cst.CSTVisitor):
            def visit_SimpleString(self, node: cst.SimpleString) -> None:
                found.append(id(node))

            def visit_FormattedString(self, node: cst.FormattedString) -> None:
                found.append(id(node))

        module.visit(_Strings())
        for node_id in found:
            if node_id in self._leftovers:
                _, line, column, kind, api, reason = self._leftovers[node_id]
                self._add_finding(line, column, kind, api, reason)
        lines = {f.line for f in self.findings}
        for node, body in self._cuda_sources:  # unless the call building it was reported
            line, column = self._pos(node)
            if line not in lines:
                self._add_finding(line, column, "unsupported", body,
                                  "a CUDA source file: port the kernels to the backend")

    # ----------------------------------------------------------------- calls

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        func = original_node.func
        qname = self._qname(func)
        rules = self._arg_rules.pop(id(original_node), None)
        method = func.attr.value if isinstance(func, cst.Attribute) else None
        if method == "cuda":
            if not (qname is not None and qname.startswith("torch.")):
                return self._cuda_method(original_node, updated_node)
            self._finding(original_node, "unsupported", qname,  # torch.Tensor.cuda(x)
                          f"unbound .cuda call: use x.to({self.backend.name!r})")
        if self._is_amp_callable(qname) and self._goes_to_torch_amp(func):
            assert qname is not None
            if id(original_node) not in self._unfixable_amp_calls:
                return self._amp_call(original_node, updated_node, qname)
            if isinstance(func, cst.Name):  # its import moved to torch.amp: needs a human
                reason = f"cannot add the device automatically; pass {self.backend.name!r} by hand"
                self._finding(original_node, "unsupported", qname, reason)
        if qname in CPP_EXTENSION_LOADERS:
            self._cpp_extension(original_node, qname)
        result = self._call_args(original_node, updated_node, qname, rules)
        if qname in GRAD_SCALERS and isinstance(result, cst.Call):
            result = self._default_device(original_node, result, qname)
        return result

    def _default_device(self, original: cst.Call, updated: cst.Call, qname: str) -> cst.Call:
        """``torch.amp.GradScaler()`` means ``GradScaler("cuda")``: name the backend."""
        if any(arg.star or arg.keyword is None or arg.keyword.value == "device"
               for arg in updated.args):
            return updated
        device = cst.Arg(value=cst.SimpleString(f'"{self.backend.name}"'))
        result = updated.with_changes(args=_layout([device, *updated.args],
                                                   _trailing(updated.args)))
        self._change_nodes(original, result, "default-device",
                           f"{qname.rsplit('.', 1)[1]}'s device defaults to \"cuda\"")
        return result

    def _cuda_method(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        """``x.cuda(...)`` -> ``x.to("<name>...", ...)``, keeping the other arguments."""
        args = list(updated.args)
        if any(arg.star for arg in args):
            self._finding(original, "unsupported", ".cuda(*args)", "starred call; edit by hand")
            return updated
        device_arg: cst.Arg | None = None
        device_orig: cst.BaseExpression | None = None
        rest: list[cst.Arg] = []
        positional = 0
        for orig_arg, arg in zip(original.args, args, strict=True):
            if arg.keyword is None:
                if positional == 0:
                    device_arg, device_orig = arg, orig_arg.value
                elif positional == 1:  # Tensor.cuda(device, non_blocking)
                    rest.append(arg.with_changes(keyword=cst.Name("non_blocking"), equal=_eq()))
                else:
                    self._finding(original, "unsupported", ".cuda(...)", "unexpected arguments")
                    return updated
                positional += 1
            elif arg.keyword.value == "device":
                device_arg, device_orig = arg, orig_arg.value
            else:
                rest.append(arg)
        device, note = self._cuda_device_value(
            None if device_arg is None else device_arg.value, device_orig)
        if device_arg is None:
            first = cst.Arg(value=device)
        else:
            first = device_arg.with_changes(
                value=device, keyword=None, equal=cst.MaybeSentinel.DEFAULT
            )
        func = updated.func
        assert isinstance(func, cst.Attribute)
        result = updated.with_changes(
            func=func.with_changes(attr=cst.Name("to")),
            args=_layout([first, *rest], _trailing(args)),
        )
        self._change_nodes(original, result, ".cuda()", note)
        return result

    def _cuda_device_value(
        self, value: cst.BaseExpression | None, original: cst.BaseExpression | None
    ) -> tuple[cst.BaseExpression, str]:
        """The ``.to()`` argument for ``.cuda(value)``.

        ``.cuda()`` takes None (the current device), an index, a string or a torch.device,
        and so does ``.to()`` except for None (no move) and an index (the current
        accelerator's device N, the backend's here). So: a literal becomes ``"sim..."``, a
        value proven to be an int ``f"sim:{n}"``, one proven not None stays as it is, and
        one that may be None becomes ``"sim" if x is None else x``.
        """
        name = self.backend.name
        if value is None or _is_none(value):
            return cst.SimpleString(f'"{name}"'), ""
        if isinstance(value, cst.Integer):
            return cst.SimpleString(f'"{name}:{value.evaluated_value}"'), ""
        rewritten = rewrite_device_expr(value, self.backend)
        if rewritten is not None:
            return rewritten, ""
        if isinstance(value, (cst.SimpleString, cst.FormattedString, cst.ConcatenatedString)):
            return value, ""  # not a CUDA string: .to() reads it as .cuda() did
        assert original is not None
        kind = self._value_kind(original)
        code = _code(original)
        if kind == "int":
            if not any(ch in code for ch in "\"'\\\n#{}"):
                fstring = cst.FormattedString(
                    parts=[
                        cst.FormattedStringText(f"{name}:"),
                        cst.FormattedStringExpression(expression=value),
                    ],
                    start='f"',
                    end='"',
                )
                return fstring, ""
            fmt = cst.Attribute(value=cst.SimpleString(f'"{name}:{{}}"'), attr=cst.Name("format"))
            return cst.Call(func=fmt, args=[cst.Arg(value=value)]), ""
        if kind is not None or any(code in guard for guard in self._guards):
            return value, ""
        if isinstance(value, (cst.Name, cst.Attribute, cst.Subscript)):
            test = cst.Comparison(left=value.deep_clone(), comparisons=[
                cst.ComparisonTarget(operator=cst.Is(), comparator=cst.Name("None"))])
            choice = cst.IfExp(test=test, body=cst.SimpleString(f'"{name}"'), orelse=value)
            return choice, f"`{code}` may be None, which .cuda() takes as the current device"
        return value, f"assumes `{code}` is not None (.cuda(None) is the current device)"

    def _value_kind(self, node: cst.BaseExpression, depth: int = 0) -> str | None:
        """"int", "value" (anything but None) or None (unknown) for a ``.cuda()`` argument."""
        if isinstance(node, cst.Integer):
            return "int"
        if isinstance(node, (cst.SimpleString, cst.FormattedString, cst.ConcatenatedString)):
            return "value"
        if isinstance(node, cst.Call):
            qname = self._qname(node.func) or _dotted(node.func) or ""
            if qname in {"int", "len"}:
                return "int"
            return "value" if qname == "str" or qname.startswith("torch.") else None
        if isinstance(node, cst.BinaryOperation):
            sides = {self._value_kind(node.left, depth), self._value_kind(node.right, depth)}
            return "int" if sides == {"int"} else "value"
        if isinstance(node, cst.IfExp):
            return _combine([self._value_kind(node.body, depth),
                             self._value_kind(node.orelse, depth)])
        if isinstance(node, cst.Name) and depth < 4:
            return _combine([self._binding_kind(b, depth) for b in self._referents(node)] or
                            [None])
        if isinstance(node, cst.Attribute) and node.attr.value in self.survey.int_attrs:
            return "int"  # args.gpu, from add_argument("--gpu", type=int, default=0)
        return None

    def _referents(self, node: cst.Name) -> list[cst.CSTNode | None]:
        scope = self.get_metadata(ScopeProvider, node, None)
        if scope is None:
            return []
        for access in scope.accesses[node.value]:
            if access.node is node:
                return [r.node if isinstance(r, Assignment) else None for r in access.referents]
        return []

    def _binding_kind(self, binding: cst.CSTNode | None, depth: int) -> str | None:
        if isinstance(binding, cst.Param):
            annotation, default = binding.annotation, binding.default
        elif binding is not None and id(binding) in self.survey.bindings:
            default, annotation = self.survey.bindings[id(binding)]
            if default is not None and annotation is None:
                return self._value_kind(default, depth + 1)
        else:
            return None
        if annotation is None or _is_none(default):
            return None
        spelled = _code(annotation.annotation)
        if spelled == "int":
            return "int"
        return "value" if spelled in {"str", "torch.device"} else None

    def _amp_call(self, original: cst.Call, updated: cst.Call, qname: str) -> cst.BaseExpression:
        """``torch.cuda.amp.autocast(...)`` -> ``torch.amp.autocast("<name>", ...)`` etc."""
        kind = AMP_CALLABLES[qname.rsplit(".", 1)[1]]
        args = list(updated.args)
        device = cst.SimpleString(f'"{self.backend.name}"')
        if kind == "autocast":
            rest: list[cst.Arg] = []
            positional = 0
            for arg in args:
                if arg.keyword is None:
                    keyword = cst.Name(CUDA_AUTOCAST_POSITIONAL[positional])
                    arg = arg.with_changes(keyword=keyword, equal=_eq())
                    positional += 1
                rest.append(arg)
            new_args = _layout([cst.Arg(value=device), *rest], _trailing(args))
        elif kind == "device-arg":
            new_args = _layout([cst.Arg(value=device), *args], _trailing(args))
        elif any(arg.keyword is not None and arg.keyword.value == "device_type" for arg in args):
            new_args = args
        else:
            new_args = _layout([*args, _kwarg("device_type", device)], _trailing(args))
        result = updated.with_changes(args=new_args)
        self._change_nodes(original, result, "torch.cuda.amp")
        return result

    def leave_Decorator(
        self, original_node: cst.Decorator, updated_node: cst.Decorator
    ) -> cst.Decorator:
        decorator = original_node.decorator
        if (
            isinstance(decorator, cst.Call)
            or not self._is_amp_callable(self._qname(decorator))
            or not self._goes_to_torch_amp(decorator)
        ):
            return updated_node
        device = cst.SimpleString(f'"{self.backend.name}"')
        call = cst.Call(func=updated_node.decorator, args=[_kwarg("device_type", device)])
        self._change(decorator, "torch.cuda.amp", "@" + _code(decorator), "@" + _code(call))
        return updated_node.with_changes(decorator=call)

    def _cpp_extension(self, original: cst.Call, qname: str) -> None:
        uses_cuda = any(
            arg.keyword is not None and arg.keyword.value in {"cuda_sources", "with_cuda"}
            for arg in original.args
        ) or any(text.endswith((".cu", ".cuh")) for text in _strings_in(original))
        if uses_cuda:
            reason = "builds CUDA sources; port the kernels to the backend"
            self._finding(original, "unsupported", qname, reason)

    def _rules_for(self, call: cst.Call, qname: str | None) -> list[_ArgRule | None]:
        """What each argument of ``call`` holds, judged on the original node."""
        func = call.func
        method = func.attr.value if isinstance(func, cst.Attribute) else None
        first_is_device = (
            qname in DEVICE_FIRST_ARG_CALLS
            or (qname is not None and qname.startswith("torch.cuda."))
            or (method == "to" and qname is None)
        )
        first_is_collective = (qname or method or "").endswith("init_process_group")
        positional_values = [a.value for a in call.args if a.keyword is None and not a.star]
        argparse_hint = None
        if method == "add_argument":
            for value in positional_values:
                if isinstance(value, cst.SimpleString):
                    argparse_hint = argparse_hint or _hint(_string_body(value) or "")
        # os.environ.get("DEVICE", "cuda"), os.getenv("LOCAL_DEVICE", "cuda:0")
        lookup_hint = None
        if (method in {"get", "getenv", "setdefault", "pop"} and positional_values
                and isinstance(positional_values[0], cst.SimpleString)):
            lookup_hint = _hint(_string_body(positional_values[0]) or "")
        # str(x.device).startswith("cuda")
        prefix_test = (method in {"startswith", "endswith"} and isinstance(func, cst.Attribute)
                       and self._is_device_operand(func.value))
        rules: list[_ArgRule | None] = []
        positional = 0
        for arg in call.args:
            rule: _ArgRule | None = None
            if arg.star:
                rules.append(None)
                continue
            if arg.keyword is None:
                if positional == 0 and first_is_device:
                    rule = _ArgRule("device")
                elif positional == 1 and qname == "torch.load":
                    rule = _ArgRule("device", containers=True)
                elif positional == 0 and first_is_collective:
                    rule = _ArgRule("backend")
                elif positional == 1 and lookup_hint:
                    rule = _ArgRule(lookup_hint)
                elif positional == 0 and prefix_test:
                    rule = _ArgRule("prefix")
                positional += 1
            else:
                keyword = arg.keyword.value
                if _device_keyword(keyword) or (qname == "torch.device" and keyword == "type"):
                    rule = _ArgRule("device", containers=keyword == "map_location")
                elif "backend" in keyword.lower():
                    rule = _ArgRule("backend")
                elif keyword in {"default", "choices"} and argparse_hint:
                    rule = _ArgRule(argparse_hint, containers=keyword == "choices")
                else:  # f(accel="cuda"), add_argument(default="cuda")
                    rule = _ArgRule("any", containers=True, strict=True)
            rules.append(rule)
        return rules

    def _call_args(
        self, original: cst.Call, updated: cst.Call, qname: str | None,
        rules: list[_ArgRule | None] | None = None,
    ) -> cst.BaseExpression:
        """Device / collective strings in the arguments of ordinary calls."""
        if rules is None:
            rules = self._rules_for(original, qname)
        args = list(updated.args)
        changed = False
        for index, (orig_arg, arg, rule) in enumerate(
                zip(original.args, args, rules, strict=True)):
            if rule is None:
                continue
            new_value = self._rewrite_value(arg.value, rule.kind, rule.containers, rule.strict)
            if new_value is None:
                continue
            args[index] = arg.with_changes(value=new_value)
            changed = True
            note = ""
            if rule.containers and rule.kind == "device" and isinstance(arg.value, cst.Dict):
                note = "map_location keys name the device a checkpoint was saved on"
            self._change_nodes(orig_arg, args[index], self._rule_of(rule.kind, arg.value), note)
        return updated.with_changes(args=args) if changed else updated

    def _rewrite_value(
        self, value: cst.BaseExpression, kind: str, containers: bool = False,
        strict: bool = False,
    ) -> cst.BaseExpression | None:
        if kind == "device":
            new = rewrite_device_expr(value, self.backend, containers=containers)
            if new is None and containers is False:  # devices = ["cuda:0", "cuda:1"]
                new = rewrite_device_expr(value, self.backend, containers=True, strict=True)
            return new
        if kind == "backend":
            return rewrite_collective_expr(value, self.backend, containers=containers,
                                           strict=strict)
        if kind == "prefix":
            if isinstance(value, cst.SimpleString) and _string_body(value) in {"cuda", "cuda:"}:
                return _with_body(value, self.backend.name + (_string_body(value) or "")[4:])
            return rewrite_device_expr(value, self.backend)
        # "any": a place that takes no particular kind of string
        return (rewrite_device_expr(value, self.backend, containers=containers, strict=True)
                or rewrite_collective_expr(value, self.backend, containers=containers,
                                           strict=True))

    @staticmethod
    def _rule_of(kind: str, before: cst.BaseExpression) -> str:
        if kind != "any":
            return _rule(kind)
        return "device-string" if _is_strict_device(before) else "collective"

    def _is_device_operand(self, node: cst.BaseExpression) -> bool:
        """``x.device.type``, ``*device*``, ``str(dev)`` where ``dev`` holds a device..."""
        if isinstance(node, cst.Attribute) and node.attr.value == "type":
            return True
        if (isinstance(node, cst.Call) and isinstance(node.func, cst.Name)
                and node.func.value in {"str", "repr"} and len(node.args) == 1):
            return self._is_device_operand(node.args[0].value)
        code = _code(node)
        if _hint(code) == "device" or code in self.survey.device_names:
            return True
        return isinstance(node, cst.Attribute) and node.attr.value in self.survey.device_attrs

    # ----------------------------------------------------------------- other contexts

    def leave_Comparison(
        self, original_node: cst.Comparison, updated_node: cst.Comparison
    ) -> cst.BaseExpression:
        """``x.device.type == "cuda"``, ``"cuda" in str(device)``, ``dev == "cuda"``: CUDA's
        answer is the spec, so the literal becomes the backend's name."""
        kind = None
        for operand in [original_node.left, *(c.comparator for c in original_node.comparisons)]:
            if isinstance(operand, (cst.SimpleString, cst.Tuple, cst.List, cst.Set)):
                continue
            if self._is_device_operand(operand):
                kind = kind or "device"
            kind = kind or _hint(_code(operand))
        if kind is None:
            return updated_node
        left = self._rewrite_value(updated_node.left, kind, containers=True)
        changed = left is not None
        comparisons = []
        for comparison in updated_node.comparisons:
            new = self._rewrite_value(comparison.comparator, kind, containers=True)
            if new is not None:
                changed = True
                comparison = comparison.with_changes(comparator=new)
            comparisons.append(comparison)
        if not changed:
            return updated_node
        result = updated_node.with_changes(left=left or updated_node.left, comparisons=comparisons)
        self._change_nodes(original_node, result, _rule(kind))
        return result

    def _strict_value(self, value: cst.BaseExpression, kind: str | None
                      ) -> tuple[cst.BaseExpression | None, str]:
        """Rewrite a value whose place says nothing (``kind`` None) or names its kind."""
        if kind is None:
            new = self._rewrite_value(value, "any", containers=True, strict=True)
            return new, self._rule_of("any", value)
        return self._rewrite_value(value, kind), _rule(kind)

    def _assigned(
        self,
        original: cst.Assign | cst.AnnAssign,
        updated: cst.Assign | cst.AnnAssign,
        targets: Sequence[cst.BaseExpression],
    ) -> cst.Assign | cst.AnnAssign:
        """``device = "cuda"`` / ``backend = "nccl"``: the target's name says what it holds;
        ``dev = "cuda"``, ``args.accel = "cuda:0"``: the value is a device string anyway."""
        if updated.value is None:
            return updated
        kind = None
        for target in targets:
            kind = kind or _hint(_code(target))
        new, rule = self._strict_value(updated.value, kind)
        if new is None:
            return updated
        result = updated.with_changes(value=new)
        self._change_nodes(original, result, rule)
        return result

    def leave_Assign(self, original_node: cst.Assign, updated_node: cst.Assign) -> cst.Assign:
        result = self._assigned(
            original_node, updated_node, [t.target for t in original_node.targets]
        )
        assert isinstance(result, cst.Assign)
        return result

    def leave_AnnAssign(
        self, original_node: cst.AnnAssign, updated_node: cst.AnnAssign
    ) -> cst.AnnAssign:
        result = self._assigned(original_node, updated_node, [original_node.target])
        assert isinstance(result, cst.AnnAssign)
        return result

    def leave_Param(self, original_node: cst.Param, updated_node: cst.Param) -> cst.Param:
        if updated_node.default is None:
            return updated_node
        new, rule = self._strict_value(updated_node.default, _hint(original_node.name.value))
        if new is None:
            return updated_node
        result = updated_node.with_changes(default=new)
        self._change_nodes(original_node, result, rule)
        return result

    def leave_DictElement(
        self, original_node: cst.DictElement, updated_node: cst.DictElement
    ) -> cst.DictElement:
        key = original_node.key
        body = _string_body(key) if isinstance(key, cst.SimpleString) else None
        kind = _hint(body or "")
        if kind is None and self._in_device_arg:
            return updated_node  # map_location={...}: rewritten as a whole by the call
        new, rule = self._strict_value(updated_node.value, kind)
        if new is None:
            return updated_node
        result = updated_node.with_changes(value=new)
        self._change_nodes(original_node, result, rule)
        return result

    def _strict_child(self, original: cst.CSTNode, updated: cst.CSTNode,
                      field_name: str) -> cst.CSTNode:
        """``return "cuda"``, ``lambda: "cuda:0"``, ``for d in ("cuda", "cpu")``."""
        value = getattr(updated, field_name)
        if value is None or not isinstance(value, cst.BaseExpression):
            return updated
        new, rule = self._strict_value(value, None)
        if new is None:
            return updated
        result = updated.with_changes(**{field_name: new})
        self._change(original, rule, _code(getattr(original, field_name)), _code(new))
        return result

    def leave_Return(self, original_node: cst.Return, updated_node: cst.Return) -> cst.Return:
        result = self._strict_child(original_node, updated_node, "value")
        assert isinstance(result, cst.Return)
        return result

    def leave_Yield(self, original_node: cst.Yield, updated_node: cst.Yield) -> cst.Yield:
        result = self._strict_child(original_node, updated_node, "value")
        assert isinstance(result, cst.Yield)
        return result

    def leave_Lambda(self, original_node: cst.Lambda, updated_node: cst.Lambda) -> cst.Lambda:
        if self._in_device_arg:
            return updated_node  # map_location=lambda s, loc: "cuda": the call's rule
        result = self._strict_child(original_node, updated_node, "body")
        assert isinstance(result, cst.Lambda)
        return result

    def leave_For(self, original_node: cst.For, updated_node: cst.For) -> cst.For:
        result = self._strict_child(original_node, updated_node, "iter")
        assert isinstance(result, cst.For)
        return result

    # ----------------------------------------------------------------- imports

    def visit_Import(self, node: cst.Import) -> None:
        self._import_depth += 1

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        self._import_depth += 1

    def _note_import(self, qualified: str) -> None:
        if qualified == "torch" or qualified.startswith("torch."):
            self.imports_torch = True
        if self._def_depth == 0 and qualified == self.backend.module:
            self.has_backend_import = True
        top = qualified.partition(".")[0]
        if top in DEVICE_CHOOSING_LIBRARIES and top not in self.device_libraries:
            self.device_libraries.append(top)

    def _import_findings(self, node: cst.CSTNode, qualified: str, module: str = "") -> None:
        for name in (module, qualified):
            reason = classify_module(name) if name else None
            if reason is not None:
                self._finding(node, "unsupported", name, reason)
                break
        if qualified.startswith("torch."):
            self._classify(node, qualified)

    @staticmethod
    def _alias_list(
        aliases: Sequence[cst.ImportAlias], parenthesized: bool = False
    ) -> list[cst.ImportAlias]:
        """A trailing comma is only legal inside parentheses (where it may carry a comment)."""
        out = list(aliases)
        comma = out[-1].comma
        keep = (
            parenthesized
            and isinstance(comma, cst.Comma)
            and isinstance(comma.whitespace_after, cst.ParenthesizedWhitespace)
        )
        if not keep:
            out[-1] = out[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
        return out

    def _record_import(
        self, original: cst.BaseSmallStatement, new: Sequence[cst.BaseSmallStatement]
    ) -> None:
        after = "\n".join(_code(stmt) for stmt in new)
        rule = "torch.cuda.amp" if "amp" in after else "torch.cuda"
        self._change(original, rule, _code(original), after)

    def leave_Import(
        self, original_node: cst.Import, updated_node: cst.Import
    ) -> cst.BaseSmallStatement | cst.FlattenSentinel[cst.BaseSmallStatement]:
        self._import_depth -= 1
        out: list[cst.BaseSmallStatement] = []
        pending: list[cst.ImportAlias] = []
        changed = False
        for orig_alias, alias in zip(original_node.names, updated_node.names, strict=True):
            name = _dotted(alias.name) or ""
            self._note_import(name)
            self._import_findings(orig_alias, name)
            parts = name.split(".")
            if parts[:2] != ["torch", "cuda"] or is_unsupported(name):
                pending.append(alias)
                continue
            changed = True
            if len(parts) >= 3 and parts[2] == "amp":
                new_name = ".".join(["torch", "amp", *parts[3:]])
                pending.append(alias.with_changes(name=_dotted_node(new_name)))
            elif alias.asname is None or len(parts) == 2:
                # `import torch.cuda[.x]` binds `torch`; the backend module is enough.
                backend_module = _dotted_node(f"torch.{self.backend.name}")
                pending.append(alias.with_changes(name=backend_module))
            else:  # import torch.cuda.x as y -> from torch.<name> import x as y
                if pending:
                    out.append(updated_node.with_changes(names=self._alias_list(pending)))
                    pending = []
                module = ".".join(["torch", self.backend.name, *parts[2:-1]])
                only = alias.with_changes(name=cst.Name(parts[-1]), comma=cst.MaybeSentinel.DEFAULT)
                out.append(cst.ImportFrom(module=_dotted_node(module), names=[only]))
        if not changed:
            return updated_node
        if pending:
            out.append(updated_node.with_changes(names=self._alias_list(pending)))
        self._record_import(original_node, out)
        return out[0] if len(out) == 1 else cst.FlattenSentinel(out)

    def leave_ImportFrom(
        self, original_node: cst.ImportFrom, updated_node: cst.ImportFrom
    ) -> cst.BaseSmallStatement | cst.FlattenSentinel[cst.BaseSmallStatement]:
        self._import_depth -= 1
        if updated_node.relative or updated_node.module is None:
            return updated_node
        module = _dotted(updated_node.module) or ""
        parts = module.split(".")
        self._note_import(module)
        if isinstance(updated_node.names, cst.ImportStar):
            self._import_findings(original_node, module)
            if module == "torch.cuda":
                backend_module = _dotted_node(f"torch.{self.backend.name}")
                result = updated_node.with_changes(module=backend_module)
                self._record_import(original_node, [result])
                return result
            return updated_node
        assert not isinstance(original_node.names, cst.ImportStar)
        groups: list[tuple[str, list[cst.ImportAlias]]] = []
        for orig_alias, alias in zip(original_node.names, updated_node.names, strict=True):
            name = _dotted(alias.name) or ""
            self._note_import(f"{module}.{name}")
            self._import_findings(orig_alias, f"{module}.{name}", module)
            target = module
            if module == "torch" and name == "cuda":  # from torch import sim as cuda
                alias = alias.with_changes(
                    name=cst.Name(self.backend.name),
                    asname=alias.asname or cst.AsName(name=cst.Name("cuda")),
                )
            elif parts[:2] == ["torch", "cuda"]:
                target = self._from_cuda_target(parts, name)
            if groups and groups[-1][0] == target:
                groups[-1][1].append(alias)
            else:
                groups.append((target, [alias]))
        if len(groups) == 1:
            target, aliases = groups[0]
            result = updated_node.with_changes(module=_dotted_node(target), names=aliases)
            if _code(result) == _code(updated_node):
                return updated_node
            self._record_import(original_node, [result])
            return result
        out: list[cst.BaseSmallStatement] = [
            updated_node.with_changes(
                module=_dotted_node(target),
                names=self._alias_list(aliases, updated_node.lpar is not None),
            )
            for target, aliases in groups
        ]
        self._record_import(original_node, out)
        return cst.FlattenSentinel(out)

    def _from_cuda_target(self, parts: list[str], name: str) -> str:
        """Module to import ``name`` from, for ``from torch.cuda[.sub] import name``."""
        qualified = ".".join([*parts, name])
        if is_unsupported(qualified):
            return ".".join(parts)
        if len(parts) == 2 and name == "amp":
            return "torch"
        if len(parts) >= 3 and parts[2] == "amp":
            return ".".join(["torch", "amp", *parts[3:]])
        return ".".join(["torch", self.backend.name, *parts[2:]])

    def leave_SimpleStatementLine(
        self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine
    ) -> cst.SimpleStatementLine | cst.FlattenSentinel[cst.SimpleStatementLine]:
        # An import split in two (``from torch.cuda import nvtx, synchronize``) gets one line each.
        if len(original_node.body) != 1 or len(updated_node.body) == 1:
            return updated_node
        lines = []
        for index, stmt in enumerate(updated_node.body):
            stmt = stmt.with_changes(semicolon=cst.MaybeSentinel.DEFAULT)
            if index == 0:
                lines.append(updated_node.with_changes(body=[stmt]))
            else:
                lines.append(cst.SimpleStatementLine(body=[stmt]))
        return cst.FlattenSentinel(lines)

    # ----------------------------------------------------------------- module

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        self._report_leftovers(updated_node)
        # A module changed for the device needs the backend, and so do one asking for the
        # current accelerator and a script using torch (its device may come from the
        # command line, or from a library such as transformers' Trainer picking the
        # accelerator), and one importing a library that chooses its device from a list of
        # vendors (it sees the device once the backend is registered); a CPU-only module it
        # imports stays byte-identical.
        needed = (bool(self.changes) or self.uses_accelerator or bool(self.device_libraries)
                  or (self.survey.entry_point and self.imports_torch))
        if self.has_backend_import or not needed:
            return updated_node
        index, anchor, where = self._insertion_point(original_node)
        added = backend_import_line(self.backend)
        statement = cst.parse_statement(added + "\n")
        body = list(updated_node.body)
        body.insert(index, statement)
        libraries = tuple(self.device_libraries)
        why = "; ".join(f"{lib}: " + DEVICE_CHOOSING_LIBRARIES[lib].format(
            device=self.backend.name) for lib in libraries)
        if anchor is None:
            self.changes.append(Change(self.path, 1, 1, "backend-import", "", added, why,
                                       libraries))
        else:
            before = _code(anchor).splitlines()[0]
            after = f"{before}\n{added}" if where == "after" else f"{added}\n{before}"
            note = f"inserted {where} this line" + (f"; {why}" if why else "")
            self._change(anchor, "backend-import", before, after, note)
            self.changes[-1].libraries = libraries
        return updated_node.with_changes(body=body)

    def _insertion_point(self, module: cst.Module) -> tuple[int, cst.CSTNode | None, str]:
        """Where the backend import goes: (body index, anchor statement, "after"/"before").

        After the first top-level ``import torch...``, unless an earlier statement
        already needs the backend (then right before it); at the top (after the
        docstring and ``__future__`` imports) when torch is only imported with
        ``from torch import ...``.
        """
        body = module.body
        top = 0
        for index, stmt in enumerate(body):
            if (index == 0 and _is_docstring(stmt)) or _is_future_import(stmt):
                top = index + 1
            else:
                break
        after_torch = next(
            (index + 1 for index, stmt in enumerate(body) if _imports_torch_module(stmt)), None
        )
        change_lines = {change.line for change in self.changes}
        first_changed = None
        for index, stmt in enumerate(body):
            span = self.get_metadata(PositionProvider, stmt)
            if any(span.start.line <= line <= span.end.line for line in change_lines):
                first_changed = index
                break
        if after_torch is not None:
            if first_changed is None or first_changed >= after_torch:
                return after_torch, body[after_torch - 1], "after"
            index = max(first_changed, top)
            return index, body[index], "before"
        if top > 0:
            return top, body[top - 1], "after"
        return 0, (body[0] if body else None), "before"


def _amp_call_fixable(call: cst.Call, qname: str) -> bool:
    """Whether the device argument can be added mechanically (no ``*args``/``**kw``)."""
    if any(arg.star for arg in call.args):
        return False
    positional = sum(1 for arg in call.args if arg.keyword is None)
    if AMP_CALLABLES[qname.rsplit(".", 1)[1]] == "autocast":
        return positional <= len(CUDA_AUTOCAST_POSITIONAL)
    return True


def backend_import_line(backend: Backend) -> str:
    """The inserted import; the noqa keeps ``ruff --fix``/autoflake from deleting it as unused."""
    return f'import {backend.module}  # noqa: F401  registers the "{backend.name}" device'


def _is_docstring(stmt: cst.CSTNode) -> bool:
    return (
        isinstance(stmt, cst.SimpleStatementLine)
        and len(stmt.body) == 1
        and isinstance(stmt.body[0], cst.Expr)
        and isinstance(stmt.body[0].value, (cst.SimpleString, cst.ConcatenatedString))
    )


def _is_future_import(stmt: cst.CSTNode) -> bool:
    return isinstance(stmt, cst.SimpleStatementLine) and any(
        isinstance(small, cst.ImportFrom) and _dotted(small.module) == "__future__"
        for small in stmt.body
    )


def _imports_torch_module(stmt: cst.CSTNode) -> bool:
    """``import torch`` / ``import torch.nn as nn`` / ``import os, torch`` at top level."""
    if not isinstance(stmt, cst.SimpleStatementLine):
        return False
    for small in stmt.body:
        if isinstance(small, cst.Import):
            for alias in small.names:
                name = _dotted(alias.name) or ""
                if name == "torch" or name.startswith("torch."):
                    return True
    return False


def rewrite_source(
    source: str | bytes, backend: str | Backend = "sim", *, path: str = "<string>"
) -> SourceResult:
    """Rewrite one module; ``bytes`` in gives ``bytes`` out so encoding cookies survive.

    Raises ``libcst.ParserSyntaxError`` for code that does not parse and
    ``SyntaxError``/``UnicodeDecodeError`` for bytes that cannot be decoded.
    Unchanged modules come back as the very same object that was passed in.
    """
    backend = Backend.parse(backend)
    wrapper = MetadataWrapper(cst.parse_module(source))
    survey = _SurveyVisitor()
    wrapper.module.visit(survey)
    rewriter = _Rewriter(backend, path, survey.survey)
    new_module = wrapper.visit(rewriter)
    findings = sorted(rewriter.findings, key=lambda f: (f.line, f.column))
    if not rewriter.changes:
        return SourceResult(source, [], findings)
    code: str | bytes = new_module.bytes if isinstance(source, bytes) else new_module.code
    changes = sorted(rewriter.changes, key=lambda c: (c.line, c.column))
    return SourceResult(code, changes, findings)


def migrate_source(code: str, backend: str | Backend = "sim") -> tuple[str, list[Change]]:
    """Migrate a snippet of Python source; returns the new code and the changes made."""
    result = rewrite_source(code, backend)
    assert isinstance(result.code, str)
    return result.code, result.changes
