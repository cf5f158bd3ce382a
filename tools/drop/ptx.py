"""The few PTX integer instructions a drop's inline-asm converters use, run on the CPU, read from the drop's source.

The Hopper W4A8 kernel widens packed e2m1 weights to e4m3 in registers with an inline-asm converter
(moe_hopper_fp8/mxfp4_cutedsl.py, `convert_mxfp4_pair_preprocessed_signs`): two PRMT lookups per half whose tables
are built by `mad.lo.u32` from the exponent offset. Its constants are the kernel's exponent window: a drop that moves
the window one binade changes four constants and nothing else, and every W4A8 weight doubles. So the audit reads the
converter's asm from the candidate tree (by AST; nothing is imported) and runs it here, instruction by instruction, on
the bytes the shim lays out (tools/drop/numerics.py). An instruction this module does not know is an error naming it:
the numbers are then not checked, which the audit reports as a break rather than guess.

Registers are Python ints masked to 32 bits; `prmt.b32` is the default (non-mode) byte permute.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from typing import Callable, Dict, List, Optional, Tuple

from tools.drop.source_model import DropIndex

__all__ = ["AsmFunction", "NotEmulated", "find_asm_function", "run"]

M32 = 0xFFFFFFFF


class NotEmulated(Exception):
    """The converter uses something this module cannot run (an instruction, an operand form)."""


@dataclasses.dataclass(frozen=True)
class AsmFunction:
    """One inline-asm body: its instructions, which $n are outputs, which function parameter feeds each input."""

    where: str  # "rel/path.py:line" of the asm call in the drop
    lines: Tuple[str, ...]
    outputs: int
    inputs: Tuple[str, ...]  # the Python parameter behind $outputs, $outputs + 1, ...


def _prmt(a: int, b: int, c: int) -> int:
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        byte = src[sel & 7]
        if sel & 8:  # sign-replicate
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


_OPS: Dict[str, Callable[..., int]] = {
    "and.b32": lambda a, b: a & b,
    "or.b32": lambda a, b: a | b,
    "xor.b32": lambda a, b: a ^ b,
    "not.b32": lambda a: ~a & M32,
    "shl.b32": lambda a, b: (a << min(b, 32)) & M32,
    "shr.u32": lambda a, b: a >> min(b, 32),
    "shr.b32": lambda a, b: a >> min(b, 32),
    "add.u32": lambda a, b: (a + b) & M32,
    "add.s32": lambda a, b: (a + b) & M32,
    "sub.u32": lambda a, b: (a - b) & M32,
    "sub.s32": lambda a, b: (a - b) & M32,
    "mul.lo.u32": lambda a, b: (a * b) & M32,
    "mul.lo.s32": lambda a, b: (a * b) & M32,
    "mad.lo.u32": lambda a, b, c: (a * b + c) & M32,
    "mad.lo.s32": lambda a, b, c: (a * b + c) & M32,
    "mov.b32": lambda a: a,
    "mov.u32": lambda a: a,
    "prmt.b32": _prmt,
}

_INSTR = re.compile(r"^\s*([a-z][\w.]*)\s+(.*?)\s*;\s*$")


def run(asm: AsmFunction, args: Dict[str, int]) -> Tuple[int, ...]:
    """The outputs $0..$(outputs-1) of `asm` for the given input values (by Python parameter name)."""
    regs: Dict[str, int] = {}
    for i, name in enumerate(asm.inputs):
        regs[f"${asm.outputs + i}"] = args[name] & M32

    def value(tok: str) -> int:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        try:
            return int(tok, 0) & M32
        except ValueError:
            raise NotEmulated(f"operand {tok!r} (in {asm.where})") from None

    for line in asm.lines:
        m = _INSTR.match(line)
        if m is None:
            raise NotEmulated(f"asm line {line!r} (in {asm.where})")
        op, operands = m.group(1), [o.strip() for o in m.group(2).split(",")]
        if op not in _OPS:
            raise NotEmulated(f"PTX instruction {op} (in {asm.where}): tools/drop/ptx.py runs {sorted(_OPS)}")
        regs[operands[0]] = _OPS[op](*(value(o) for o in operands[1:]))
    return tuple(regs.get(f"${i}", 0) for i in range(asm.outputs))


def _string(node: ast.AST) -> Optional[str]:
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left, right = _string(node.left), _string(node.right)
            return left + right if left is not None and right is not None else None
        return None
    return value if isinstance(value, str) else None


def find_asm_function(index: DropIndex, module: str, name: str) -> AsmFunction:
    """The inline asm of the drop function `module.name` (one `*.inline_asm(type, [operands], asm, constraints)`
    call), read by AST."""
    found = index.find_function(module, name)
    if found is None:
        raise NotEmulated(f"no function {name} in {module}")
    mod, func = found
    calls = [n for n in ast.walk(func) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "inline_asm" and len(n.args) >= 4]
    if len(calls) != 1:
        raise NotEmulated(f"{mod}.{name} holds {len(calls)} inline_asm calls; expected one")
    call = calls[0]
    where = f"{index.rel(mod)}:{call.lineno}"
    text, constraints = _string(call.args[2]), _string(call.args[3])
    if text is None or constraints is None or not isinstance(call.args[1], (ast.List, ast.Tuple)):
        raise NotEmulated(f"the asm or its constraints at {where} are not literal strings")
    inputs: List[str] = []
    for operand in call.args[1].elts:
        # `src0.ir_value()` -> the parameter src0
        base = operand.func.value if isinstance(operand, ast.Call) and isinstance(operand.func, ast.Attribute) \
            else operand
        if not isinstance(base, ast.Name):
            raise NotEmulated(f"operand {ast.unparse(operand)} at {where}")
        inputs.append(base.id)
    kinds = [c.strip() for c in constraints.split(",")]
    outputs = sum(1 for c in kinds if c.startswith("="))
    if outputs + len(inputs) != len(kinds):
        raise NotEmulated(f"constraints {constraints!r} at {where} do not match {len(inputs)} operands")
    body = [s.strip() for s in text.replace("{", "\n").replace("}", "\n").split("\n")]
    lines = tuple(s for s in body if s and not s.startswith(".reg") and not s.startswith("//"))
    return AsmFunction(where, lines, outputs, tuple(inputs))
