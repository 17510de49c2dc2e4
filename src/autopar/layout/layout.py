"""``Layout``: where the pieces of one tensor live -- the one idea that carries the parallel system.

    Layout(device_matrix=(2, 4), tensor_map=(1, -1), full_shape=(512, 128))

Dimension 0 of the tensor is split along device-matrix axis 1 (4 parts); dimension 1 is not split; devices that
differ only along axis 0 hold the same piece (replicas). Axes are counted **from the left** (as DTensor mesh dims
and JAX's PartitionSpec; MindSpore's strategy files count from the right). Ranks are laid on the device matrix in
row-major order. A strategy is parsed into Layouts, execution turns a Layout into DTensor placements on the world
mesh (:mod:`autopar.layout.axes`), strategy files and checkpoints store Layouts, and the planner chooses them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.errors import StrategyError


@dataclass(frozen=True)
class Layout:
    device_matrix: tuple[int, ...]
    tensor_map: tuple[int, ...]
    full_shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.tensor_map) != len(self.full_shape):
            raise StrategyError(f"tensor map {self.tensor_map} does not match shape {self.full_shape}")
        used = [a for a in self.tensor_map if a >= 0]
        if len(set(used)) != len(used) or any(a >= len(self.device_matrix) for a in used):
            raise StrategyError(f"tensor map {self.tensor_map} is invalid for device matrix {self.device_matrix}")
        for dim, axis in enumerate(self.tensor_map):
            if axis >= 0 and self.full_shape[dim] % self.device_matrix[axis]:
                raise StrategyError(
                    f"dimension {dim} of size {self.full_shape[dim]} cannot be split into "
                    f"{self.device_matrix[axis]} equal parts"
                )

    # -- construction ---------------------------------------------------------------------------------------------
    @classmethod
    def replicated(cls, full_shape: tuple[int, ...], device_num: int) -> "Layout":
        return cls((device_num,), (-1,) * len(full_shape), tuple(full_shape))

    # -- what it means --------------------------------------------------------------------------------------------
    @property
    def device_num(self) -> int:
        return math.prod(self.device_matrix)

    @property
    def splits(self) -> tuple[int, ...]:
        """Number of parts of each tensor dimension (MindSpore's strategy for this tensor)."""
        return tuple(self.device_matrix[a] if a >= 0 else 1 for a in self.tensor_map)

    @property
    def slice_shape(self) -> tuple[int, ...]:
        return tuple(s // p for s, p in zip(self.full_shape, self.splits))

    @property
    def num_replicas(self) -> int:
        return self.device_num // math.prod(self.splits)

    def coordinates(self, rank: int) -> tuple[int, ...]:
        coords = []
        for size in reversed(self.device_matrix):
            coords.append(rank % size)
            rank //= size
        return tuple(reversed(coords))

    def slice_index(self, rank: int) -> tuple[int, ...]:
        """Which part of each dimension ``rank`` holds."""
        c = self.coordinates(rank)
        return tuple(c[a] if a >= 0 else 0 for a in self.tensor_map)

    def offsets(self, rank: int) -> tuple[int, ...]:
        return tuple(i * s for i, s in zip(self.slice_index(rank), self.slice_shape))

    def slices(self, rank: int) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offsets(rank), self.slice_shape))

    def is_replicated(self) -> bool:
        return all(a < 0 for a in self.tensor_map)

    # -- DTensor ------------------------------------------------------------------------------------------------
    def placements(self, mesh_shape: tuple[int, ...] | None = None):
        """DTensor placements of this layout on the world mesh (or on the mesh of ``mesh_shape``, for planning)."""
        from torch.distributed.tensor import Replicate, Shard

        from autopar.layout.axes import axes_of_device_matrix, current_mesh_shape

        shape = current_mesh_shape() if mesh_shape is None else mesh_shape
        groups = axes_of_device_matrix(self.device_matrix, shape)
        out = [Replicate() for _ in shape]
        for dim, axis in enumerate(self.tensor_map):
            if axis >= 0:
                for m in groups[axis]:
                    out[m] = Shard(dim)
        return tuple(out)

    @classmethod
    def from_placements(cls, placements, full_shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> "Layout":
        """The layout of a DTensor: device matrix = mesh shape, each sharded dim on its mesh axis.

        A dim sharded over several mesh axes is expressed by merging them (they are consecutive and in order
        for every layout autopar creates)."""
        dims: dict[int, list[int]] = {}
        for m, p in enumerate(placements):
            if p.is_shard():
                dims.setdefault(p.dim, []).append(m)
        matrix: list[int] = []
        tmap = [-1] * len(full_shape)
        m = 0
        owner = {tuple(axes): d for d, axes in dims.items()}
        while m < len(mesh_shape):
            group = next((axes for axes in owner if axes[0] == m), None)
            if group and list(group) == list(range(m, m + len(group))):
                tmap[owner[group]] = len(matrix)
                matrix.append(math.prod(mesh_shape[a] for a in group))
                m += len(group)
            else:
                matrix.append(mesh_shape[m])
                m += 1
        return cls(tuple(matrix), tuple(tmap), tuple(full_shape))

    # -- serialisation / display -----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"full_shape": list(self.full_shape), "device_matrix": list(self.device_matrix),
                "tensor_map": list(self.tensor_map), "slice_shape": list(self.slice_shape)}

    @classmethod
    def from_dict(cls, d: dict) -> "Layout":
        return cls(tuple(d["device_matrix"]), tuple(d["tensor_map"]), tuple(d["full_shape"]))

    def __str__(self) -> str:
        spec = ",".join("R" if a < 0 else f"S{a}" for a in self.tensor_map)
        return f"[{spec}] on {self.device_matrix}"
