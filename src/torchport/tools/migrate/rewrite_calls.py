"""The call rules of the rewriter (a mixin of its transformer): ``.cuda()`` and
``.to("cuda")``, device arguments by position and keyword, AMP calls given their device,
decorators, C++/CUDA extension loaders."""

from __future__ import annotations

import libcst as cst
from libcst.metadata import (
    Assignment,
    ScopeProvider,
)

from torchport.tools.migrate.apis import (
    AMP_CALLABLES,
    CPP_EXTENSION_LOADERS,
    CUDA_AUTOCAST_POSITIONAL,
    DEVICE_FIRST_ARG_CALLS,
    GRAD_SCALERS,
)
from torchport.tools.migrate.cst_util import _code, _dotted, _eq, _kwarg, _layout, _trailing
from torchport.tools.migrate.device_strings import (
    _device_keyword,
    _hint,
    _string_body,
    _strings_in,
    _with_body,
    rewrite_collective_expr,
    rewrite_device_expr,
)
from torchport.tools.migrate.survey import _ArgRule, _combine, _is_none, _is_strict_device, _rule


class CallRules:
    """``leave_Call`` and the rules it applies; state and helpers are the rewriter's."""

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


def _amp_call_fixable(call: cst.Call, qname: str) -> bool:
    """Whether the device argument can be added mechanically (no ``*args``/``**kw``)."""
    if any(arg.star for arg in call.args):
        return False
    positional = sum(1 for arg in call.args if arg.keyword is None)
    if AMP_CALLABLES[qname.rsplit(".", 1)[1]] == "autocast":
        return positional <= len(CUDA_AUTOCAST_POSITIONAL)
    return True
