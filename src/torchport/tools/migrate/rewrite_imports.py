"""The import rules of the rewriter (a mixin of its transformer): CUDA modules and names
imported, renamed or reported, and the findings of unsupported modules."""

from __future__ import annotations

from collections.abc import Sequence

import libcst as cst

from torchport.tools.migrate.apis import (
    DEVICE_CHOOSING_LIBRARIES,
    classify_module,
    is_unsupported,
)
from torchport.tools.migrate.cst_util import _code, _dotted, _dotted_node


class ImportRules:
    """``Import``/``ImportFrom`` rewrites and the import-time findings."""

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
