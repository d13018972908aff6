"""Kubernetes quantities and the API server's rules on a container's resources, as pure functions (no client).

Used by the schema (grpolora.api.spec, through grpolora.api.kubetypes) when `grpolora validate` and the operator
check a job, and by `validate --cluster` to read a node's allocatable.

`parse` follows k8s.io/apimachinery pkg/api/resource/quantity.go (ParseQuantity and its scanner
parseQuantityString; suffix.go for the suffixes), to the value: `<sign><digits>.<digits><suffix>` where the suffix is
binary (Ki..Ei), decimal (n, u, m, "", k, M, G, T, P, E) or an exponent (e3, E-2); a non-zero value finer than a
nano is rounded away from zero to one; a binary quantity is capped at 2^63-1. The scanner's quirks are kept: a
sign, a point or a suffix without digits reads as 0 (`Gi`, `.`, `-`), and the API server takes them as such.

`requirements_problems` is kubernetes pkg/apis/core/validation/validation.go ValidateResourceRequirements (with
ValidateResourceQuantityValue and validateContainerResourceName) for one container: quantities not negative,
extended resources whole, a request at most its limit, and equal to it for a resource that cannot be overcommitted
(extended resources, hugepages), which also needs a limit. Messages are the API server's words.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from fractions import Fraction
from typing import Any, Final

FORMAT_PATTERN: Final = r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
"""The pattern apimachinery's ErrFormatWrong names (its scanner, not this pattern, decides)."""

_DECIMAL: Final = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_BINARY: Final = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_SUFFIX_CHARS: Final = frozenset("eEinumkKMGTP")
_DIGITS: Final = frozenset("0123456789")
_NANO: Final = 10**9
_MAX_BINARY: Final = 2**63 - 1
_MAX_EXPONENT: Final = 1000  # beyond it a decimal exponent only makes a number too large to compute with; clamped
STANDARD_CONTAINER_RESOURCES: Final = ("cpu", "memory", "ephemeral-storage")
HUGEPAGES_PREFIX: Final = "hugepages-"


class QuantityError(ValueError):
    """Not a quantity; the message is apimachinery's error for it."""


def parse(quantity: str | int | float) -> Fraction:
    """The exact value of a quantity as the API server reads it (a JSON number by its text, as kubectl sends it)."""
    text = (repr(quantity) if isinstance(quantity, float) else str(quantity)).strip()
    if not text:
        raise QuantityError(f"quantities must match the regular expression '{FORMAT_PATTERN}'")
    negative, number, denominator, suffix = _scan(text)
    if suffix in _DECIMAL:
        base, exponent = 10, _DECIMAL[suffix]
    elif suffix in _BINARY:
        base, exponent = 2, _BINARY[suffix]
    elif len(suffix) > 1 and suffix[0] in "eE" and _is_int(suffix[1:]):
        base, exponent = 10, max(-_MAX_EXPONENT, min(_MAX_EXPONENT, int(suffix[1:])))
    else:
        raise QuantityError("unable to parse quantity's suffix")
    value = Fraction(int(number + denominator), 10 ** len(denominator)) * Fraction(base) ** exponent
    if value and value * _NANO != int(value * _NANO):
        value = Fraction(int(value * _NANO) + 1, _NANO)  # rounded up to the next nano (inf.RoundUp)
    if base == 2:
        value = min(value, Fraction(_MAX_BINARY))
    return -value if negative else value


def _scan(text: str) -> tuple[bool, str, str, str]:
    """parseQuantityString: (negative, numerator digits, fraction digits, suffix); QuantityError when malformed."""
    negative, pos, end = text[0] == "-", 0, len(text)
    if text[0] in "+-":
        pos = 1
    while pos < end and text[pos] == "0":
        pos += 1
    if pos == end:
        return negative, "0", "", ""
    start = pos
    while pos < end and text[pos] in _DIGITS:
        pos += 1
    number, denominator = text[start:pos] or "0", ""
    if pos < end and text[pos] == ".":
        pos += 1
        start = pos
        while pos < end and text[pos] in _DIGITS:
            pos += 1
        denominator = text[start:pos]
    suffix_start = pos
    while pos < end and text[pos] in _SUFFIX_CHARS:
        pos += 1
    if pos < end and text[pos] in "+-":
        pos += 1
    while pos < end and text[pos] in _DIGITS:
        pos += 1
    if pos < end:
        raise QuantityError(f"quantities must match the regular expression '{FORMAT_PATTERN}'")
    return negative, number, denominator, text[suffix_start:]


def _is_int(text: str) -> bool:
    """strconv.ParseInt(text, 10, 64) succeeds."""
    digits = text[1:] if text[:1] in "+-" else text
    return bool(digits) and set(digits) <= _DIGITS and -(2**63) <= int(text) < 2**63


def is_native(name: str) -> bool:
    """pkg/apis/core/helper IsNativeResource: no domain, or in the kubernetes.io namespace."""
    return "/" not in name or "kubernetes.io/" in name


def overcommit_allowed(name: str) -> bool:
    """IsOvercommitAllowed: a request may be below its limit only for a native resource other than hugepages."""
    return is_native(name) and not name.startswith(HUGEPAGES_PREFIX)


def is_integer_resource(name: str) -> bool:
    """IsIntegerResourceName, for a container's resources: the extended ones (a device plugin's)."""
    return not is_native(name) and not name.startswith("requests.")


def requirements_problems(resources: Mapping[str, Any], path: str = "") -> Iterator[tuple[str, str]]:
    """(field path, message) for each rule of ValidateResourceRequirements that `resources` (a container's
    ResourceRequirements, schema-valid) breaks; paths are `<path>.limits.<name>` and `<path>.requests.<name>`."""
    at = f"{path}." if path else ""
    limits: dict[str, Fraction] = {}
    for section in ("limits", "requests"):
        for name, written in (resources.get(section) or {}).items():
            where = f"{at}{section}.{name}"
            if "/" not in name and not (name in STANDARD_CONTAINER_RESOURCES or name.startswith(HUGEPAGES_PREFIX)):
                yield where, (
                    f'Invalid value: "{name}": must be a standard resource for containers ('
                    f"{', '.join(STANDARD_CONTAINER_RESOURCES)}, {HUGEPAGES_PREFIX}<size>), or an extended resource "
                    "with a domain (vendor.com/name)"
                )
                continue
            try:
                value = parse(written)
            except QuantityError as exc:
                yield where, f"Invalid value: {_shown(written)}: {exc} (e.g. 500m, 2, 16Gi)"
                continue
            if value < 0:
                yield where, f"Invalid value: {_shown(written)}: must be greater than or equal to 0"
                continue
            if is_integer_resource(name) and value.denominator != 1:
                yield where, f"Invalid value: {_shown(written)}: must be an integer"
                continue
            if section == "limits":
                limits[name] = value
                continue
            written_limit = (resources.get("limits") or {}).get(name)
            if name in limits:
                if value != limits[name] and not overcommit_allowed(name):
                    yield where, f"Invalid value: {_shown(written)}: must be equal to {name} limit of {written_limit}"
                elif value > limits[name]:
                    yield where, (
                        f"Invalid value: {_shown(written)}: must be less than or equal to {name} limit of "
                        f"{written_limit}"
                    )
            elif written_limit is None and not overcommit_allowed(name):
                yield f"{at}limits.{name}", "Required value: Limit must be set for non overcommitable resources"


def _shown(written: Any) -> str:
    return f'"{written if not isinstance(written, float) else repr(written)}"'
