"""Device and collective-backend strings: where a ``"cuda"`` names a device (``"cuda:1"``,
f-strings and ``%``/``{}`` templates, conditional arms, tuples of devices) and its
rewrite for the backend; the strings left in a module, for the report."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import libcst as cst

from torchport.tools.migrate.cst_util import (
    _COLLECTIVE_SPEC_RE,
    _DEVICE_RE,
    _DEVICE_TEMPLATE_RE,
    _DEVICE_TYPE_RE,
    _STRICT_TEMPLATE_RE,
)
from torchport.tools.migrate.model import Backend

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
