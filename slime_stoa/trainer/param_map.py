"""Where each tensor of an HF checkpoint lives in the transformers model built from it.

The learner publishes the checkpoint's own tensors (its names and shapes), while transformers may
hold them otherwise: a tied head is not duplicated, a buffer is not a parameter (LFM2-MoE's
``expert_bias``), and fused expert tensors hold many checkpoint tensors each (LFM2-MoE's
``experts.gate_up_proj[e]`` is the concatenation of ``experts.{e}.w1.weight`` and
``experts.{e}.w3.weight``, ``experts.down_proj[e]`` is ``experts.{e}.w2.weight``, as transformers'
conversion mapping for ``lfm2_moe`` fuses them on load). `checkpoint_slots` finds, for every
checkpoint name, the tensor (parameter or buffer) and the slice of it that holds it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

SlotKind = Literal["parameter", "buffer"]

#: A checkpoint's per-expert tensor and the fused tensor that holds it: (prefix, expert, w1/w2/w3).
_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<w>w[123])\.weight$")


@dataclass(frozen=True, slots=True)
class Slot:
    """A checkpoint tensor inside a model tensor: ``model_tensor[expert, rows]`` (both optional)."""

    tensor: str  # the parameter's or buffer's name in the model
    kind: SlotKind
    expert: int | None = None  # the leading index of a fused expert tensor
    rows: tuple[int, int] | None = None  # a row range of that expert's matrix (w1 / w3 in gate_up_proj)

    def view(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The checkpoint tensor's view of `tensors[self.tensor]` (writes go through)."""
        t = tensors[self.tensor]
        if self.expert is not None:
            t = t[self.expert]
        if self.rows is not None:
            t = t[self.rows[0] : self.rows[1]]
        return t


def checkpoint_slots(
    model: torch.nn.Module, names: Sequence[str], shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, Slot]:
    """The slot of each checkpoint tensor `names` (with their `shapes`) in `model`; ValueError
    naming the first one the model does not hold, or holds with another shape."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    slots: dict[str, Slot] = {}
    for name in names:
        if name in params:
            slot = Slot(name, "parameter")
        elif name in buffers:
            slot = Slot(name, "buffer")
        elif (m := _EXPERT.match(name)) and f"{m['prefix']}.gate_up_proj" in params:
            expert = int(m["expert"])
            if m["w"] == "w2":
                slot = Slot(f"{m['prefix']}.down_proj", "parameter", expert)
            else:
                fused = f"{m['prefix']}.gate_up_proj"
                half = params[fused].shape[1] // 2
                slot = Slot(fused, "parameter", expert, (0, half) if m["w"] == "w1" else (half, 2 * half))
        else:
            raise ValueError(f"checkpoint tensor {name} is neither a parameter nor a buffer of the model")
        tensors = params if slot.kind == "parameter" else buffers
        if slot.expert is not None and slot.expert >= tensors[slot.tensor].shape[0]:
            raise ValueError(f"checkpoint tensor {name}: the model's {slot.tensor} has no expert {slot.expert}")
        got = tuple(slot.view(tensors).shape)
        if got != tuple(shapes[name]):
            raise ValueError(f"checkpoint tensor {name} has shape {tuple(shapes[name])}, the model's slot {got}")
        slots[name] = slot
    return slots
