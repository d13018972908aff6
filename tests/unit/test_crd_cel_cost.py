"""The CRD's CEL rules stay within the API server's cost limits, estimated as the API server estimates them.

A real API server refuses a CRD whose rule's *estimated* worst-case cost exceeds 10,000,000 units, or whose rules
together exceed 100,000,000 (apiextensions-apiserver: StaticEstimatedCostLimit, StaticEstimatedCRDCostLimit). The
estimate assumes the largest values the schema allows: a string without maxLength, a list without maxItems, a map
without maxProperties is assumed to fill the whole 3 MiB request. This module re-implements that estimate for the
CEL constructs our rules use (cel-go's checker/cost.go with Kubernetes' size estimator):
- sizes (apiextensions model.SchemaDeclType): a string with maxLength n counts 4n bytes (a code point may take 4),
  else 3 MiB - 2; a list maxItems, else (3 MiB - 2) / (its item's minimum JSON size + 1); a map maxProperties, else
  (3 MiB - 2) / (minimum value size + 6); objects and integers 0, int literals 1, string literals their length;
- costs: identifier and field select 1, has() 1 + its operand, literals 0, && and || both sides, a ternary the
  condition plus the dearer branch, integer arithmetic and comparisons 1, `==`/`!=` ceil(0.1 x the smaller size)
  (objects compare at size 0 in the estimate), `matches` ceil(0.1 x (string size + 1)) x ceil(0.25 x regex
  length), `startsWith`/`endsWith` ceil(0.1 x the affix's size), `size()` 1, `exists(x, p)` iterations x (4 +
  cost of p) + 1.
Cost factors rounded up, as cel-go does. A rule under a list or map counts once per possible element.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import celpy
from lark import Token, Tree

from grpolora.api.crd import crd

MAX_REQUEST = 3 * 1024 * 1024  # apiserver's DefaultMaxRequestSizeBytes
UNKNOWN = 2**64 - 1
STATIC_RULE_LIMIT = 10_000_000  # StaticEstimatedCostLimit
STATIC_CRD_LIMIT = 100_000_000  # StaticEstimatedCRDCostLimit
CEL_KEY = "x-kubernetes-validations"


# ---- schema -> CEL declaration sizes (model.SchemaDeclType) -----------------------------------------------------


@dataclass
class Decl:
    kind: str  # string, int, bool, double, list, map, object, dyn
    max_elements: int = 0
    min_size: int = 1
    bounded: bool = True
    fields: dict[str, Decl] = field(default_factory=dict)
    elem: Decl | None = None
    path: str = ""


def decl(schema: Mapping[str, Any], path: str = "self", *, root: bool = False) -> Decl | None:
    if schema.get("x-kubernetes-int-or-string"):
        return Decl("dyn", MAX_REQUEST - 2, 1, bounded=False, path=path)
    if root:
        schema = with_object_meta(schema)
    kind = schema.get("type")
    if kind == "array":
        items = decl(schema.get("items") or {}, f"{path}[]") if isinstance(schema.get("items"), dict) else None
        if items is None:
            return None
        bounded = "maxItems" in schema
        count = schema["maxItems"] if bounded else (MAX_REQUEST - 2) // (items.min_size + 1)
        return Decl("list", count, 2, bounded, elem=items, path=path)
    if kind == "object":
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            values = decl(extra, f"{path}{{}}")
            if values is None:
                return None
            bounded = "maxProperties" in schema
            count = schema["maxProperties"] if bounded else (MAX_REQUEST - 2) // (values.min_size + 6)
            return Decl("map", count, 2, bounded, elem=values, path=path)
        fields, min_size = {}, 2
        required = set(schema.get("required") or [])
        for name, sub in (schema.get("properties") or {}).items():
            child = decl(sub, f"{path}.{name}")
            if child is None:
                continue
            fields[name] = child
            if name in required and "default" not in sub:
                min_size += len(name) + child.min_size + 4
        return Decl("object", 0, min_size, fields=fields, path=path)
    if kind == "string":
        if "maxLength" in schema:
            return Decl("string", schema["maxLength"] * 4, 2, path=path)
        return Decl("string", MAX_REQUEST - 2, 2, bounded=False, path=path)
    return {
        "integer": Decl("int", path=path),
        "boolean": Decl("bool", path=path),
        "number": Decl("double", path=path),
    }.get(kind or "")


def with_object_meta(schema: Mapping[str, Any]) -> Mapping[str, Any]:
    """model.WithTypeAndObjectMeta as Kubernetes releases without its 253-character name cap apply it: unless the
    schema types kind, apiVersion, metadata.name and metadata.generateName as strings, they are added as unbounded
    strings (newer servers cap the name at 253 themselves)."""
    props = schema.get("properties") or {}
    meta = (props.get("metadata") or {}).get("properties") or {}
    typed = all(props.get(k, {}).get("type") == "string" for k in ("kind", "apiVersion"))
    if typed and all(meta.get(k, {}).get("type") == "string" for k in ("name", "generateName")):
        return schema
    string = {"type": "string"}
    metadata = {"type": "object", "properties": {"name": string, "generateName": string}}
    return {**schema, "properties": {**props, "kind": string, "apiVersion": string, "metadata": metadata}}


# ---- the cost of one rule (cel-go checker/cost.go) ---------------------------------------------------------------


@dataclass
class Est:
    cost: int
    size: int = UNKNOWN
    decl: Decl | None = None


@dataclass
class Estimator:
    variables: dict[str, Decl]
    unbounded: set[str] = field(default_factory=set)
    """Unbounded values that reached a size-dependent operation (what maxLength/maxItems/maxProperties would fix)."""

    def size_of(self, est: Est) -> int:
        if est.decl is not None and not est.decl.bounded:
            self.unbounded.add(est.decl.path)
        return est.size

    def run(self, node: Tree | Token) -> Est:
        assert isinstance(node, Tree), node
        handler = getattr(self, f"_{node.data}", None)
        if handler is not None:
            return handler(node)
        if len(node.children) == 1:  # expr, conditionalor, relation, addition, unary, member, primary ...
            return self.run(node.children[0])
        raise NotImplementedError(f"CEL construct not modelled: {node.data}")

    def _expr(self, node: Tree) -> Est:
        if len(node.children) == 1:
            return self.run(node.children[0])
        cond, yes, no = (self.run(child) for child in node.children)
        return Est(cond.cost + max(yes.cost, no.cost), max(yes.size, no.size), yes.decl or no.decl)

    def _logical(self, node: Tree) -> Est:
        if len(node.children) == 1:
            return self.run(node.children[0])
        return Est(sum(self.run(child).cost for child in node.children), 1)

    _conditionalor = _conditionaland = _logical

    def _relation(self, node: Tree) -> Est:
        if len(node.children) == 1:
            return self.run(node.children[0])
        op, right = node.children
        left, rhs = self.run(op.children[0]), self.run(right)
        if op.data in ("relation_eq", "relation_ne"):
            # Equality stops at the shorter side: only two unbounded sides make it unbounded.
            smallest = min(left.size, rhs.size)
            if smallest == left.size == rhs.size:
                self.size_of(left), self.size_of(rhs)
            else:
                self.size_of(left if left.size == smallest else rhs)
            return Est(math.ceil(smallest * 0.1) + left.cost + rhs.cost, 1)
        return Est(1 + left.cost + rhs.cost, 1)

    def _arithmetic(self, node: Tree) -> Est:
        if len(node.children) == 1:
            return self.run(node.children[0])
        op, right = node.children
        return Est(1 + self.run(op.children[0]).cost + self.run(right).cost, 1)

    _addition = _multiplication = _arithmetic

    def _unary(self, node: Tree) -> Est:
        if len(node.children) == 1:
            return self.run(node.children[0])
        return Est(1 + self.run(node.children[1]).cost, 1)

    def _paren_expr(self, node: Tree) -> Est:
        return self.run(node.children[0])

    def _literal(self, node: Tree) -> Est:
        raw = str(node.children[0])
        raw = raw[1:] if raw[:1] in "rR" else raw
        for quote in ('"""', "'''", '"', "'"):
            if raw.startswith(quote):
                return Est(0, len(raw) - 2 * len(quote))  # a string's size is its length (escapes count high)
        return Est(0, 1)

    def _ident(self, node: Tree) -> Est:
        found = self.variables.get(str(node.children[0]))
        assert found is not None, f"unknown identifier {node.children[0]}"
        return Est(1, found.max_elements, found)

    def _member_dot(self, node: Tree) -> Est:
        operand, name = self.run(node.children[0]), str(node.children[1])
        child = operand.decl.fields.get(name) if operand.decl is not None else None
        assert child is not None, f"{operand.decl.path if operand.decl else '?'} has no field {name} in the schema"
        return Est(operand.cost + 1, child.max_elements, child)

    def _ident_arg(self, node: Tree) -> Est:
        name, args = str(node.children[0]), node.children[1]
        if name == "has":  # a presence test: 1 plus the cost of what is selected from
            (selected,) = args.children
            dot = next(t for t in selected.iter_subtrees_topdown() if t.data == "member_dot")  # the outermost
            return Est(1 + self.run(dot.children[0]).cost, 1)
        if name in ("double", "int"):  # a numeric conversion: a constant-cost call (1) on its argument's cost
            (value,) = (self.run(arg) for arg in args.children)
            return Est(1 + value.cost, 1)
        raise NotImplementedError(f"function {name}() not modelled")

    def _member_dot_arg(self, node: Tree) -> Est:
        target, name = self.run(node.children[0]), str(node.children[1])
        args = node.children[2].children if len(node.children) > 2 else []
        if name == "matches":
            (pattern,) = (self.run(arg) for arg in args)
            string = math.ceil((self.size_of(target) + 1) * 0.1)
            return Est(string * math.ceil(pattern.size * 0.25) + target.cost + pattern.cost, 1)
        if name in ("startsWith", "endsWith"):  # checker/cost.go: the prefix's (suffix's) size x 0.1, plus args
            (affix,) = (self.run(arg) for arg in args)
            return Est(math.ceil(affix.size * 0.1) + target.cost + affix.cost, 1)
        if name == "size":
            return Est(1 + target.cost, 1)
        if name in ("exists", "all"):
            variable, predicate = args
            var_name = str(next(variable.find_data("ident")).children[0])
            assert target.decl is not None and target.decl.elem is not None
            inner = Estimator({**self.variables, var_name: target.decl.elem}, self.unbounded)
            body = inner.run(predicate).cost
            # range + result identifier + per element: not_strictly_false(!result) (3) and result || predicate (1 + p)
            return Est(target.cost + 1 + self.size_of(target) * (4 + body), 1)
        raise NotImplementedError(f"method {name}() not modelled")


@dataclass(frozen=True)
class RuleCost:
    location: str
    rule: str
    cost: int
    cardinality: int
    unbounded: frozenset[str]


def rule_costs(schema: Mapping[str, Any]) -> list[RuleCost]:
    """Every rule of the CRD's schema with its estimated cost, how often it can run, and the unbounded values that
    its size-dependent operations read."""
    environment = celpy.Environment()
    found: list[RuleCost] = []

    def walk(sub: Mapping[str, Any], where: str, cardinality: int, root: bool) -> None:
        here = decl(sub, "self", root=root)
        for rule in sub.get(CEL_KEY) or []:
            assert here is not None
            estimator = Estimator({"self": here, "oldSelf": here})
            cost = estimator.run(environment.compile(rule["rule"])).cost
            found.append(RuleCost(where or "<root>", rule["rule"], cost, cardinality, frozenset(estimator.unbounded)))
        for name, child in (sub.get("properties") or {}).items():
            walk(child, f"{where}.{name}", cardinality, False)
        for key, suffix in (("items", "[]"), ("additionalProperties", "{}")):
            if isinstance(sub.get(key), dict):
                container = decl(sub, "self")
                count = container.max_elements if container is not None else 1
                walk(sub[key], where + suffix, cardinality * max(count, 1), False)

    walk(schema, "", 1, True)
    return found


def our_schema() -> dict[str, Any]:
    return crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


# ---- the model against the examples in the Kubernetes docs -------------------------------------------------------


def test_the_model_refuses_what_the_kubernetes_docs_say_is_refused_and_passes_the_bounded_variant():
    # Docs (CRD validation rules, resource use): a rule that matches every string of an unbounded list of unbounded
    # strings exceeds the budget by a factor of more than 100x; with maxItems and maxLength it passes.
    rule = [{"rule": "self.all(x, x.matches('^[a-zA-Z]*$'))"}]
    unbounded = {
        "type": "object",
        "properties": {"names": {"type": "array", "items": {"type": "string"}, CEL_KEY: rule}},
    }
    (cost,) = rule_costs(unbounded)
    assert cost.cost > 100 * STATIC_RULE_LIMIT
    assert cost.unbounded == {"self", "self[]"}
    bounded = {"type": "array", "maxItems": 100, "items": {"type": "string", "maxLength": 64}, CEL_KEY: rule}
    (cost,) = rule_costs({"type": "object", "properties": {"names": bounded}})
    assert cost.cost < 100_000 and not cost.unbounded


# ---- our CRD ---------------------------------------------------------------------------------------------------


def test_every_rule_of_our_crd_is_within_the_api_servers_estimated_cost_limits():
    costs = rule_costs(our_schema())
    assert len(costs) == sum(1 for _ in iter_rules(our_schema()))
    report = "\n".join(f"{c.cost * c.cardinality:>12,}  {c.location}: {c.rule[:90]}" for c in costs)
    assert all(c.cost * c.cardinality <= STATIC_RULE_LIMIT for c in costs), report
    assert sum(c.cost * c.cardinality for c in costs) <= STATIC_CRD_LIMIT, report


def test_every_value_a_rule_reads_by_size_is_bounded_in_the_schema():
    """Strings, lists and maps whose size a rule's cost depends on (a regex match, a string or list comparison, an
    iteration) have maxLength / maxItems / maxProperties: the estimate then reflects real sizes, not 3 MiB."""
    unbounded = {(c.location, path) for c in rule_costs(our_schema()) for path in c.unbounded}
    assert not unbounded


def name_rule_cost(rule: str) -> int:
    meta = {"name": {"type": "string", "maxLength": 63}, "generateName": {"type": "string", "maxLength": 62}}
    schema = {
        "type": "object",
        "properties": {"metadata": {"type": "object", "properties": meta}, "kind": {"type": "string"},
                       "apiVersion": {"type": "string"}},
        CEL_KEY: [{"rule": rule}],
    }  # fmt: skip
    (cost,) = rule_costs(schema)
    return cost.cost


def test_single_rule_costs_follow_the_model():
    assert name_rule_cost("self.metadata.name.size() <= 42") == 5  # self, .metadata, .name, size(), <=
    # 3 selects + ceil(0.1 x (4 x 63 + 1)) x ceil(0.25 x len('^[a-z]$'))
    assert name_rule_cost("self.metadata.name.matches('^[a-z]$')") == 3 + 26 * 2
    assert name_rule_cost("has(self.metadata.name)") == 1 + 2  # the presence test, plus self.metadata
    # An int compared with an int literal: sizes 0 and 1, so the comparison costs nothing beyond its operands.
    assert name_rule_cost("self.metadata.name == 'x'") == 3 + 1


def iter_rules(schema: Mapping[str, Any]) -> Iterator[dict[str, str]]:
    yield from schema.get(CEL_KEY) or []
    for child in (schema.get("properties") or {}).values():
        yield from iter_rules(child)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            yield from iter_rules(schema[key])
