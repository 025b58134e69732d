"""Decision units: what the policy scores and switches. Granularity "block": one per block; "layer": a block's
attention layers and the rest, and a block whose two units differ streams a by-role precision (precision/by_role.py)."""

from __future__ import annotations

from typing import Mapping

import torch

from torch_stagehand.runtime import precision as precisions
from torch_stagehand.runtime.precision.by_role import ATTENTION, MLP, ByRole, by_role_name, by_roles_name, layer_role

FULL = precisions.FULL


class Units:
    def __init__(self, n_blocks: int, per_layer: bool):
        self.n_blocks = n_blocks
        self.per_layer = per_layer
        roles = (ATTENTION, MLP) if per_layer else (None,)
        self.units: list[tuple[int, str | None]] = [(b, r) for b in range(n_blocks) for r in roles]

    def __len__(self) -> int:
        return len(self.units)

    def block(self, unit: int) -> int:
        return self.units[unit][0]

    def label(self, unit: int) -> str:
        b, r = self.units[unit]
        return str(b) if r is None else f"{b}.{r}"

    def of_blocks(self, by_block: Mapping[int, str]) -> dict[int, str]:
        """{unit: value} from {block: value} (a force list, a pinned block)."""
        return {u: by_block[b] for u, (b, _) in enumerate(self.units) if b in by_block}

    def unit_map(self, block_map: Mapping[int, str]) -> dict[int, str]:
        out = {}
        for u, (b, role) in enumerate(self.units):
            entry = precisions.get(block_map[b])
            out[u] = entry.role_precision(role) if role is not None and isinstance(entry, ByRole) else entry.name
        return out

    def block_map(self, unit_map: Mapping[int, str]) -> dict[int, str]:
        if not self.per_layer:
            return dict(unit_map)
        out = {}
        for b in range(self.n_blocks):
            attention, mlp = unit_map[2 * b], unit_map[2 * b + 1]
            if attention == mlp:
                out[b] = attention
            elif attention == FULL:
                out[b] = by_role_name(mlp, MLP)
            elif mlp == FULL:
                out[b] = by_role_name(attention, ATTENTION)
            else:
                out[b] = by_roles_name(attention, mlp)
            if out[b] not in precisions.names():
                raise ValueError(f"block {b}: attention in {attention} and MLP in {mlp}: no such precision")
        return out

    def layers_of(self, unit: int, layers) -> list:
        """The streamed layers (StreamedLayerSpec) a unit holds: its block's, or those of its role."""
        b, role = self.units[unit]
        return [s for s in layers if s.block == b and (role is None or layer_role(s.fqn) == role)]

    def params(self, model: torch.nn.Module, block_fqns: list[str]) -> list[list[torch.Tensor]]:
        """Each unit's trainable parameters (a block's; per layer, split by the name's role)."""
        out = []
        for b, role in self.units:
            named = model.get_submodule(block_fqns[b]).named_parameters()
            out.append([p for n, p in named if p.requires_grad and (role is None or layer_role(n) == role)])
        return out
