"""ExactnessReport: how a converted pack relates to the checkpoint's own values, counted, never assumed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

import torch

__all__ = ["ExactnessReport"]


@dataclass
class ExactnessReport:
    """What a converter did to the checkpoint's values.

    values: weight values converted. changed: how many of them dequantize to something else than the checkpoint's
    own value (its codes times its scales, in fp32) -- 0 means the pack holds the checkpoint's values bit for bit.
    blocks / rescaled_blocks: scale blocks (or per-tensor scales) converted, and how many had to take another
    scale because moe_ep's format shares one scale where the checkpoint has two (gate and up). max_abs_err /
    max_rel_err: the largest change of a changed value, absolute and relative to the checkpoint's value.
    reciprocal_scales / reciprocal_roundtrips: fp32 scales stored as their reciprocal because that is how the
    format (and its kernels) take them (NVFP4's global scales), and how many of them give the checkpoint's scale
    back exactly as 1 / stored; q * s / g can still differ from the checkpoint's q * s * scale_2 by one fp32
    rounding, which `changed` does not count (see docs/checkpoints.md).
    notes: what else the caller should know (one line each).
    """

    convention: str
    fmt: str
    values: int = 0
    changed: int = 0
    blocks: int = 0
    rescaled_blocks: int = 0
    max_abs_err: float = 0.0
    max_rel_err: float = 0.0
    reciprocal_scales: int = 0
    reciprocal_roundtrips: int = 0
    notes: List[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        """Every stored code and scale is the checkpoint's own."""
        return self.changed == 0 and self.rescaled_blocks == 0

    def note(self, line: str) -> None:
        if line not in self.notes:
            self.notes.append(line)

    def count_change(self, before: torch.Tensor, after: torch.Tensor) -> None:
        """Count the changes in one group of values that took another scale: `before` the checkpoint's dequantized
        values, `after` the pack's (fp32, same shape; `after` is consumed). `values` is counted by the converter,
        for every value."""
        diff = after.sub_(before).abs_()
        n = int(torch.count_nonzero(diff))
        if not n:
            return
        self.changed += n
        self.max_abs_err = max(self.max_abs_err, float(diff.max()))
        # A zero stays zero under any scale, so |before| > 0 wherever diff is: the floor only avoids 0 / 0.
        rel = diff.div_(before.abs().clamp_(min=torch.finfo(torch.float32).tiny))
        self.max_rel_err = max(self.max_rel_err, float(rel.max()))

    def merge(self, other: "ExactnessReport") -> "ExactnessReport":
        self.values += other.values
        self.changed += other.changed
        self.blocks += other.blocks
        self.rescaled_blocks += other.rescaled_blocks
        self.max_abs_err = max(self.max_abs_err, other.max_abs_err)
        self.max_rel_err = max(self.max_rel_err, other.max_rel_err)
        self.reciprocal_scales += other.reciprocal_scales
        self.reciprocal_roundtrips += other.reciprocal_roundtrips
        for line in other.notes:
            self.note(line)
        return self

    def summary(self) -> str:
        head = f"{self.convention} -> {self.fmt}: "
        if self.exact:
            head += f"exact ({self.values} values, {self.blocks} scale blocks as stored)"
        else:
            share = self.changed / max(self.values, 1)
            head += (f"NOT exact: {self.rescaled_blocks} of {self.blocks} scale blocks rescaled, {self.changed} of "
                     f"{self.values} values changed ({share:.2%}), max abs err {self.max_abs_err:.3g}, max rel err "
                     f"{self.max_rel_err:.3g}")
        if self.reciprocal_scales:
            head += (f"; {self.reciprocal_scales} fp32 scales stored as reciprocals, {self.reciprocal_roundtrips} "
                     f"round-trip exactly")
        return "; ".join([head] + self.notes)
