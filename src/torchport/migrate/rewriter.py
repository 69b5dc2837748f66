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

import libcst as cst
from libcst.metadata import (
    MetadataWrapper,
    PositionProvider,
    QualifiedNameProvider,
    QualifiedNameSource,
)

from torchport.migrate.apis import (
    AMP_CALLABLES,
    CPP_EXTENSION_LOADERS,
    CUDA_AUTOCAST_POSITIONAL,
    DEVICE_FIRST_ARG_CALLS,
    NO_EFFECT_ENV_VARS,
    FindingKind,
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


def _rewrite_template(node: cst.BaseExpression, backend: Backend) -> cst.BaseExpression | None:
    if isinstance(node, cst.SimpleString):
        body = _string_body(node)
        if body is not None and _DEVICE_TEMPLATE_RE.fullmatch(body):
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
    node: cst.BaseExpression, backend: Backend, *, containers: bool = False
) -> cst.BaseExpression | None:
    """Rewrite an expression that evaluates to a device; ``None`` when nothing changed.

    Only literal parts are touched: ``"cuda:0"``, ``f"cuda:{rank}"``,
    ``"cuda:%d" % r``, ``"cuda:{}".format(r)``, ``"cuda:" + str(r)``, both arms of
    ``a if cond else b``, ``x or "cuda"``, lambda bodies and, with ``containers``,
    dict keys/values and tuple/list/set elements.
    """
    if isinstance(node, cst.SimpleString):
        body = _string_body(node)
        new = None if body is None else _device_text(body, backend)
        return None if new is None else _with_body(node, new)
    if isinstance(node, cst.FormattedString):
        parts = list(node.parts)
        if not parts or not isinstance(parts[0], cst.FormattedStringText):
            return None
        text = parts[0].value
        ok = _DEVICE_RE.fullmatch(text) if len(parts) == 1 else text == "cuda:"
        if not ok:
            return None
        parts[0] = parts[0].with_changes(value=backend.name + text[4:])
        return node.with_changes(parts=parts)
    if isinstance(node, (cst.IfExp, cst.BooleanOperation)):
        return _rewrite_arms(
            node, lambda n: rewrite_device_expr(n, backend, containers=containers))
    if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, (cst.Add, cst.Modulo)):
        left = _rewrite_template(node.left, backend)
        return None if left is None else node.with_changes(left=left)
    if (
        isinstance(node, cst.Call)
        and isinstance(node.func, cst.Attribute)
        and node.func.attr.value == "format"
    ):
        fmt = _rewrite_template(node.func.value, backend)
        return None if fmt is None else node.with_changes(func=node.func.with_changes(value=fmt))
    if isinstance(node, cst.Lambda):
        body = rewrite_device_expr(node.body, backend, containers=containers)
        return None if body is None else node.with_changes(body=body)
    if containers and isinstance(node, cst.Dict):
        changed = False
        elements: list[cst.BaseDictElement] = []
        for element in node.elements:
            if isinstance(element, cst.DictElement):
                key = rewrite_device_expr(element.key, backend)
                value = rewrite_device_expr(element.value, backend, containers=True)
                if key is not None or value is not None:
                    changed = True
                    element = element.with_changes(
                        key=key or element.key, value=value or element.value
                    )
            elements.append(element)
        return node.with_changes(elements=elements) if changed else None
    if containers and isinstance(node, (cst.Tuple, cst.List, cst.Set)):
        return _rewrite_elements(node, lambda n: rewrite_device_expr(n, backend))
    return None


def rewrite_collective_expr(
    node: cst.BaseExpression, backend: Backend, *, containers: bool = False
) -> cst.BaseExpression | None:
    """Rewrite an expression naming a torch.distributed backend (``"nccl"``)."""
    if isinstance(node, cst.SimpleString):
        body = _string_body(node)
        new = None if body is None else _collective_text(body, backend)
        return None if new is None else _with_body(node, new)
    if isinstance(node, (cst.IfExp, cst.BooleanOperation)):
        return _rewrite_arms(node, lambda n: rewrite_collective_expr(n, backend))
    if containers and isinstance(node, (cst.Tuple, cst.List, cst.Set)):
        return _rewrite_elements(node, lambda n: rewrite_collective_expr(n, backend))
    return None


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
    return "device-string" if kind == "device" else "collective"


class _Rewriter(cst.CSTTransformer):
    """Applies every rule in one pass; records changes and findings as it goes."""

    METADATA_DEPENDENCIES = (PositionProvider, QualifiedNameProvider)

    def __init__(self, backend: Backend, path: str) -> None:
        super().__init__()
        self.backend = backend
        self.path = path
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
        self.imports_torch = False
        self.has_backend_import = False

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
        if body in NO_EFFECT_ENV_VARS:
            self._finding(original_node, "no-effect", body, NO_EFFECT_ENV_VARS[body])
        return updated_node

    # ----------------------------------------------------------------- calls

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        func = original_node.func
        qname = self._qname(func)
        if (
            isinstance(func, cst.Attribute)
            and func.attr.value == "cuda"
            and not (qname is not None and qname.startswith("torch."))
        ):
            return self._cuda_method(original_node, updated_node)
        if self._is_amp_callable(qname) and self._goes_to_torch_amp(func):
            assert qname is not None
            if id(original_node) not in self._unfixable_amp_calls:
                return self._amp_call(original_node, updated_node, qname)
            if isinstance(func, cst.Name):  # its import moved to torch.amp: needs a human
                reason = f"cannot add the device automatically; pass {self.backend.name!r} by hand"
                self._finding(original_node, "unsupported", qname, reason)
        if qname in CPP_EXTENSION_LOADERS:
            self._cpp_extension(original_node, qname)
        updated_node = self._pin_memory_off(original_node, updated_node)
        return self._call_args(original_node, updated_node, qname)

    def _pin_memory_off(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        """``pin_memory=<expr>`` -> ``pin_memory=False``: page-locked memory for the device
        needs a host-allocator hook PyTorch 2.13 gives no Python backend, and with the
        CUDA test migrated to the device the expression would turn it on."""
        args = list(updated.args)
        for i, arg in enumerate(args):
            if arg.keyword is not None and arg.keyword.value == "pin_memory" and not (
                    isinstance(arg.value, cst.Name) and arg.value.value == "False"):
                args[i] = arg.with_changes(value=cst.Name("False"))
                self._change(original.args[i], "pin-memory", _code(original.args[i].value),
                             "False", "pinned host memory is not available for the device "
                             "in PyTorch 2.13; copies stay correct, without overlap")
        return updated.with_changes(args=args) if args != list(updated.args) else updated

    def _cuda_method(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        """``x.cuda(...)`` -> ``x.to("<name>...", ...)``, keeping the other arguments."""
        args = list(updated.args)
        if any(arg.star for arg in args):
            self._finding(original, "unsupported", ".cuda(*args)", "starred call; edit by hand")
            return updated
        device_arg: cst.Arg | None = None
        rest: list[cst.Arg] = []
        positional = 0
        for arg in args:
            if arg.keyword is None:
                if positional == 0:
                    device_arg = arg
                elif positional == 1:  # Tensor.cuda(device, non_blocking)
                    rest.append(arg.with_changes(keyword=cst.Name("non_blocking"), equal=_eq()))
                else:
                    self._finding(original, "unsupported", ".cuda(...)", "unexpected arguments")
                    return updated
                positional += 1
            elif arg.keyword.value == "device":
                device_arg = arg
            else:
                rest.append(arg)
        device, note = self._cuda_device_value(None if device_arg is None else device_arg.value)
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
        self, value: cst.BaseExpression | None
    ) -> tuple[cst.BaseExpression, str]:
        name = self.backend.name
        if value is None or (isinstance(value, cst.Name) and value.value == "None"):
            return cst.SimpleString(f'"{name}"'), ""
        if isinstance(value, cst.Integer):
            return cst.SimpleString(f'"{name}:{value.evaluated_value}"'), ""
        rewritten = rewrite_device_expr(value, self.backend)
        if rewritten is not None:
            return rewritten, ""
        if isinstance(value, (cst.SimpleString, cst.FormattedString, cst.Call)):
            return value, ""  # already a device (torch.device(...)) or not a CUDA string
        code = _code(value)
        note = f"assumes `{code}` is a device index"
        if not any(ch in code for ch in "\"'\\\n#{}"):
            fstring = cst.FormattedString(
                parts=[
                    cst.FormattedStringText(f"{name}:"),
                    cst.FormattedStringExpression(expression=value),
                ],
                start='f"',
                end='"',
            )
            return fstring, note
        fmt = cst.Attribute(value=cst.SimpleString(f'"{name}:{{}}"'), attr=cst.Name("format"))
        return cst.Call(func=fmt, args=[cst.Arg(value=value)]), note

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

    def _call_args(
        self, original: cst.Call, updated: cst.Call, qname: str | None
    ) -> cst.BaseExpression:
        """Device / collective strings in the arguments of ordinary calls."""
        func = original.func
        method = func.attr.value if isinstance(func, cst.Attribute) else None
        first_is_device = (
            qname in DEVICE_FIRST_ARG_CALLS
            or (qname is not None and qname.startswith("torch.cuda."))
            or (method == "to" and qname is None)
        )
        first_is_collective = (qname or method or "").endswith("init_process_group")
        argparse_hint = None
        if method == "add_argument":
            for arg in original.args:
                if arg.keyword is None and isinstance(arg.value, cst.SimpleString):
                    argparse_hint = argparse_hint or _hint(_string_body(arg.value) or "")
        args = list(updated.args)
        positional = 0
        changed = False
        for index, (orig_arg, arg) in enumerate(zip(original.args, args, strict=True)):
            if arg.star:
                continue
            kind: str | None = None
            containers = False
            if arg.keyword is None:
                if positional == 0 and first_is_device:
                    kind = "device"
                elif positional == 1 and qname == "torch.load":
                    kind, containers = "device", True
                elif positional == 0 and first_is_collective:
                    kind = "backend"
                positional += 1
            else:
                keyword = arg.keyword.value
                if _device_keyword(keyword) or (qname == "torch.device" and keyword == "type"):
                    kind, containers = "device", keyword == "map_location"
                elif "backend" in keyword.lower():
                    kind = "backend"
                elif keyword in {"default", "choices"} and argparse_hint:
                    kind, containers = argparse_hint, keyword == "choices"
            new_value = None if kind is None else self._rewrite_value(arg.value, kind, containers)
            if new_value is None:
                continue
            args[index] = arg.with_changes(value=new_value)
            changed = True
            note = ""
            if containers and isinstance(arg.value, cst.Dict):
                note = "map_location keys name the device a checkpoint was saved on"
            self._change_nodes(orig_arg, args[index], _rule(kind or ""), note)
        return updated.with_changes(args=args) if changed else updated

    def _rewrite_value(
        self, value: cst.BaseExpression, kind: str, containers: bool = False
    ) -> cst.BaseExpression | None:
        if kind == "device":
            return rewrite_device_expr(value, self.backend, containers=containers)
        return rewrite_collective_expr(value, self.backend, containers=containers)

    # ----------------------------------------------------------------- other contexts

    def leave_Comparison(
        self, original_node: cst.Comparison, updated_node: cst.Comparison
    ) -> cst.BaseExpression:
        kind = None
        for operand in [original_node.left, *(c.comparator for c in original_node.comparisons)]:
            if isinstance(operand, (cst.SimpleString, cst.Tuple, cst.List, cst.Set)):
                continue
            if isinstance(operand, cst.Attribute) and operand.attr.value == "type":
                kind = kind or "device"  # x.device.type == "cuda"
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

    def _assigned(
        self,
        original: cst.Assign | cst.AnnAssign,
        updated: cst.Assign | cst.AnnAssign,
        targets: Sequence[cst.BaseExpression],
    ) -> cst.Assign | cst.AnnAssign:
        """``device = "cuda"`` / ``backend = "nccl"``: the target's name says what it holds."""
        kind = None
        for target in targets:
            kind = kind or _hint(_code(target))
        if kind is None or updated.value is None:
            return updated
        new = self._rewrite_value(updated.value, kind)
        if new is None:
            return updated
        result = updated.with_changes(value=new)
        self._change_nodes(original, result, _rule(kind))
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
        kind = _hint(original_node.name.value)
        if kind is None or updated_node.default is None:
            return updated_node
        new = self._rewrite_value(updated_node.default, kind)
        if new is None:
            return updated_node
        result = updated_node.with_changes(default=new)
        self._change_nodes(original_node, result, _rule(kind))
        return result

    def leave_DictElement(
        self, original_node: cst.DictElement, updated_node: cst.DictElement
    ) -> cst.DictElement:
        if not isinstance(original_node.key, cst.SimpleString):
            return updated_node
        kind = _hint(_string_body(original_node.key) or "")
        new = None if kind is None else self._rewrite_value(updated_node.value, kind)
        if new is None:
            return updated_node
        result = updated_node.with_changes(value=new)
        self._change_nodes(original_node, result, _rule(kind or ""))
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
        if self.has_backend_import or not (self.imports_torch or self.changes):
            return updated_node
        index, anchor, where = self._insertion_point(original_node)
        added = backend_import_line(self.backend)
        statement = cst.parse_statement(added + "\n")
        body = list(updated_node.body)
        body.insert(index, statement)
        if anchor is None:
            self.changes.append(Change(self.path, 1, 1, "backend-import", "", added))
        else:
            before = _code(anchor).splitlines()[0]
            after = f"{before}\n{added}" if where == "after" else f"{added}\n{before}"
            self._change(anchor, "backend-import", before, after, f"inserted {where} this line")
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
    rewriter = _Rewriter(backend, path)
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
