"""Device values outside calls (a mixin of the rewriter's transformer): comparisons with
``x.device.type``, assignments, parameters' defaults, dict entries, returns, yields,
lambdas and loops."""

from __future__ import annotations

from collections.abc import Sequence

import libcst as cst

from torchport.tools.migrate.cst_util import _code
from torchport.tools.migrate.device_strings import _hint, _string_body
from torchport.tools.migrate.survey import _rule


class ContextRules:
    """The ``leave_*`` rules for device values outside calls."""

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
