"""Reading the Terraform modules in tests: python-hcl2 parses them, and `evaluate` computes the small
expressions the consistency tests need (for expressions, conditionals, a few functions) so that they run
without the terraform binary (no provider can be downloaded here, so terraform itself could only
evaluate provider-free modules anyway)."""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
from typing import Any

import hcl2
from hcl2.utils import SerializationOptions
from lark import Token, Tree

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODULES = os.path.join(REPO, "infra", "modules")
_OPTIONS = SerializationOptions(strip_string_quotes=True, explicit_blocks=False, with_comments=False)


def load(path: str) -> dict:
    """One .tf file as python-hcl2 reads it: blocks as lists, expressions as "${...}" strings."""
    with open(path) as fh:
        return hcl2.loads(fh.read(), serialization_options=_OPTIONS)


def load_module(directory: str) -> dict:
    """Every .tf file of a module: {"resource": {(type, name): body}, "data": {...}, "variable": {name: body},
    "output": {...}, "locals": {name: expr}, "module": {name: body}}."""
    out: dict[str, dict] = {"resource": {}, "data": {}, "variable": {}, "output": {}, "locals": {}, "module": {}}
    for path in sorted(glob.glob(os.path.join(directory, "*.tf"))):
        doc = load(path)
        for kind in ("resource", "data"):
            for entry in doc.get(kind, []):
                for rtype, named in entry.items():
                    for name, body in named.items():
                        out[kind][(rtype, name)] = body
        for kind in ("variable", "output", "module"):
            for entry in doc.get(kind, []):
                out[kind].update(entry)
        for entry in doc.get("locals", []):
            out["locals"].update(entry)
    return out


def expression(value: str) -> str:
    """"${expr}" -> "expr"."""
    assert isinstance(value, str) and value.startswith("${") and value.endswith("}"), value
    return value[2:-1]


# ---- a small evaluator of HCL expressions -----------------------------------------------------------

_FUNCTIONS = {
    "range": lambda *a: list(range(*[int(x) for x in a])),
    "max": max,
    "min": min,
    "merge": lambda *maps: {k: v for m in maps for k, v in m.items()},
    "tostring": lambda v: v if isinstance(v, str) else json.dumps(v),
    "length": len,
    "tonumber": lambda v: v if isinstance(v, (int, float)) else (float(v) if "." in v else int(v)),
    "lookup": lambda m, key, default: m.get(key, default),
}
_OPERATORS = {
    "==": lambda a, b: a == b, "!=": lambda a, b: a != b, "<": lambda a, b: a < b, ">": lambda a, b: a > b,
    "<=": lambda a, b: a <= b, ">=": lambda a, b: a >= b, "+": lambda a, b: a + b, "-": lambda a, b: a - b,
    "*": lambda a, b: a * b, "&&": lambda a, b: a and b, "||": lambda a, b: a or b,
}


def evaluate(expr: str, scope: dict[str, Any]) -> Any:
    """The value of HCL expression `expr` (without "${ }"), names looked up in `scope` (`{"var": {...}}`).
    Raises NotImplementedError for what it does not know, so a test never passes by accident."""
    tree = hcl2.parses_to_tree(f"value = {expr}\n")
    attribute = next(tree.find_data("attribute"))
    return _eval(_trees(attribute)[-1], scope)


def _trees(node: Tree) -> list[Tree]:
    return [c for c in node.children if isinstance(c, Tree) and c.data != "new_line_or_comment"]


def _eval(node: Tree, scope: dict) -> Any:  # noqa: C901 - one case per node type
    kind = node.data
    kids = _trees(node)
    if kind == "expr_term":
        if len(kids) != 1:
            raise NotImplementedError(f"expr_term with {len(kids)} parts")
        return _eval(kids[0], scope)
    if kind == "int_lit":
        return int(node.children[0])
    if kind == "float_lit":
        return float(node.children[0])
    if kind == "literal_value":
        return {"true": True, "false": False, "null": None}[str(node.children[0])]
    if kind == "identifier":
        name = str(node.children[0])
        if name not in scope:
            raise NotImplementedError(f"unknown name {name!r}")
        return scope[name]
    if kind == "string":
        return "".join(_string_part(p, scope) for p in kids)
    if kind == "get_attr_expr_term":
        obj = _eval(kids[0], scope)
        name = str(_trees(kids[1])[0].children[0])
        return obj[name]
    if kind == "function_call":
        name = str(kids[0].children[0])
        if name not in _FUNCTIONS:
            raise NotImplementedError(f"function {name}")
        args = [_eval(a, scope) for a in _trees(kids[1])] if len(kids) > 1 else []
        if len(kids) > 1 and any(isinstance(c, Token) and str(c) == "..." for c in kids[1].children):
            args = args[:-1] + list(args[-1])  # f(a, list...): the last argument expanded
        return _FUNCTIONS[name](*args)
    if kind == "conditional":
        return _eval(kids[1], scope) if _eval(kids[0], scope) else _eval(kids[2], scope)
    if kind == "binary_op":
        left = _eval(kids[0], scope)
        op_node, right_node = _trees(kids[1])
        op = str(op_node.children[0]) if isinstance(op_node, Tree) and op_node.data == "binary_operator" else None
        if op not in _OPERATORS:
            raise NotImplementedError(f"operator {op}")
        return _OPERATORS[op](left, _eval(right_node, scope))
    if kind == "unary_op":
        op = next(str(c) for c in node.children if isinstance(c, Token))
        value = _eval(kids[0], scope)
        return -value if op == "-" else not value
    if kind == "tuple":
        return [_eval(k, scope) for k in kids]
    if kind == "object":
        out = {}
        for elem in kids:
            key_node, value_node = _trees(elem)
            key_expr = _trees(key_node)[0]
            key_inner = _trees(key_expr)[0] if key_expr.data == "expr_term" else key_expr
            key = str(key_inner.children[0]) if key_inner.data == "identifier" else _eval(key_inner, scope)
            out[key] = _eval(value_node, scope)
        return out
    if kind == "for_tuple_expr":
        intro, body, *cond = kids
        names = [str(c.children[0]) for c in _trees(intro) if c.data == "identifier"]
        collection = _eval(_trees(intro)[-1], scope)
        items = collection.items() if isinstance(collection, dict) else enumerate(collection)
        out = []
        for key, value in items:
            inner = {**scope, **({names[0]: value} if len(names) == 1 else {names[0]: key, names[1]: value})}
            if cond and not _eval(_trees(cond[0])[0], inner):
                continue
            out.append(_eval(body, inner))
        return out
    raise NotImplementedError(f"HCL node {kind}")


def _string_part(part: Tree, scope: dict) -> str:
    inner = _trees(part)
    if not inner:
        return "".join(str(c) for c in part.children)
    if inner[0].data != "interpolation":
        raise NotImplementedError(f"string part {inner[0].data}")
    value = _eval(_trees(inner[0])[0], scope)
    return value if isinstance(value, str) else json.dumps(value)


# ---- terraform itself, for provider-free configurations ---------------------------------------------


def terraform() -> str | None:
    return shutil.which("terraform")


def terraform_env(tmp: str) -> dict:
    """No checkpoint calls, no CLI configuration warnings, plugins nowhere shared."""
    cfg = os.path.join(tmp, "terraformrc")
    open(cfg, "w").close()
    return {**os.environ, "CHECKPOINT_DISABLE": "1", "TF_IN_AUTOMATION": "1", "TF_INPUT": "0",
            "TF_CLI_CONFIG_FILE": cfg}


def terraform_outputs(directory: str) -> dict:
    """`terraform init && apply` of a configuration without providers (offline) -> its outputs' values."""
    env = terraform_env(directory)
    for cmd in (["init", "-input=false", "-no-color"], ["apply", "-auto-approve", "-input=false", "-no-color"]):
        r = subprocess.run([terraform(), *cmd], cwd=directory, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"terraform {cmd[0]}:\n{r.stdout}\n{r.stderr}"
    r = subprocess.run([terraform(), "output", "-json"], cwd=directory, env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    return {k: v["value"] for k, v in json.loads(r.stdout).items()}
