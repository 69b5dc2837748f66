"""Concrete-syntax-tree rewrite of CUDA-specific PyTorch code for a torchport backend.

Why libcst and not regular expressions: a CST keeps every comment, blank line
and quote style, and lets the rules look at *where* a string sits (argument of
``torch.device``, ``device=`` keyword, comparison with ``x.device.type``...)
so that ``"cuda"`` is only changed where it names a device.  Names are
resolved through imports (``import torch as th``, ``from torch.cuda import
synchronize``) with libcst's ``QualifiedNameProvider``.

One transformer (:class:`_Rewriter`, here: its state, names, references and the module's
backend import) applies every rule in one pass; the rules are its mixins, one module per
kind of place: calls (``rewrite_calls``), device values elsewhere (``rewrite_contexts``),
imports (``rewrite_imports``). What they share: ``survey`` (the pass before, and the
argument rules), ``device_strings`` (which strings name a device, and their rewrite) and
``cst_util``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst
from libcst.metadata import (
    MetadataWrapper,
    PositionProvider,
    QualifiedNameProvider,
    QualifiedNameSource,
    ScopeProvider,
)

from torchport.tools.migrate.apis import (
    AMP_CALLABLES,
    DEVICE_CHOOSING_LIBRARIES,
    DEVICE_GENERIC_APIS,
    FindingKind,
    classify_env_var,
    classify_torch_api,
    is_unsupported,
)
from torchport.tools.migrate.cst_util import _STRICT_TEMPLATE_RE, _code, _dotted, _root_name
from torchport.tools.migrate.device_strings import (
    _is_collective_text,
    _is_device_text,
    _string_body,
    rewrite_collective_expr,
    rewrite_device_expr,
)
from torchport.tools.migrate.model import Backend, Change, Finding
from torchport.tools.migrate.rewrite_calls import CallRules, _amp_call_fixable
from torchport.tools.migrate.rewrite_contexts import ContextRules
from torchport.tools.migrate.rewrite_imports import ImportRules
from torchport.tools.migrate.survey import (
    _LEFT_DEVICE,
    _ArgRule,
    _not_none_names,
    _Survey,
    _SurveyVisitor,
)

__all__ = [
    "SourceResult",
    "backend_import_line",
    "migrate_source",
    "rewrite_collective_expr",
    "rewrite_device_expr",
    "rewrite_source",
]

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


class _Rewriter(CallRules, ContextRules, ImportRules, cst.CSTTransformer):
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
