"""Reading a compiled program's HLO text: how many kernels one call runs (`count_kernels`,
for `infer.bench --breakdown`)."""

from __future__ import annotations

import re

_NOT_KERNELS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast",
                "after-all", "partition-id", "replica-id"}
_HLO_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s.*?\s([a-z][\w\-]*)\((?:%|\))")
_HLO_COMP = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s+\(.*\{\s*$")


def count_kernels(hlo_text: str) -> int:
    """Kernels one call of a compiled function runs: instructions of the entry computation
    and of the while/call bodies it reaches (a while body counted once per known trip;
    fusions count once, whatever they fuse)."""
    comps: dict[str, list[str]] = {}
    entry, name = None, None
    for line in hlo_text.splitlines():
        m = _HLO_COMP.match(line)
        if m:
            name = m.group(2)
            comps[name] = []
            if m.group(1):
                entry = name
            continue
        if name is not None and _HLO_INSTR.match(line):
            comps[name].append(line)

    def count(comp: str, seen: tuple = ()) -> int:
        total = 0
        for line in comps.get(comp, []):
            op = _HLO_INSTR.match(line).group(1)
            if op in _NOT_KERNELS:
                continue
            if op == "while":
                body = re.search(r"body=%?([\w.\-]+)", line).group(1)
                cond = re.search(r"condition=%?([\w.\-]+)", line).group(1)
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                n = int(trips.group(1)) if trips else 1
                total += n * (count(body, seen) + count(cond, seen))
            elif op in ("call", "conditional") and comp not in seen:
                for callee in re.findall(r"(?:to_apply|branch_computations=\{?)=?%?([\w.\-]+)",
                                         line):
                    total += count(callee, seen + (comp,))
                total += 1
            else:
                total += 1
        return total

    return count(entry) if entry else 0
