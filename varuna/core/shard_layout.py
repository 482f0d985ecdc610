"""How a stage's parameters are cut into D flat optimizer shards (ZeRO-1): pure arithmetic, shared
by the runtime (varuna/runtime/sharded_optimizer.py) and the memory model (simulator/costs.py).

Note [Optimizer shards]: the stage's trainable parameters are laid end to end in one flat space,
in the stage's parameter order, each starting at a multiple of ``ALIGN`` elements (zero padding
between them), the whole padded to ``D·S`` elements with ``S`` a multiple of ``ALIGN``. Replica
``j`` owns elements ``[j·S, (j+1)·S)``: it keeps the optimizer state of those elements only and
steps them; the updated elements are then all-gathered into every replica's flat parameter
buffer, of which the parameters are views. A parameter meets a shard in at most one interval, a
*piece*; the optimizer runs over pieces instead of parameters.

Why pieces step to the same bits as whole parameters: the optimizers accepted for sharding
(Adam, AdamW, SGD, ...) update each element from that element's gradient and state alone, so
only the kernels' per-element arithmetic could differ between a piece and its parameter. CPU
and CUDA elementwise kernels walk a tensor in vector-width blocks from its start and finish the
remainder with scalar code; a piece starts at a multiple of ``ALIGN`` from its parameter's start
and ends at one or at the parameter's end, so every element sits in the same kind of block in
the piece as in the parameter (``ALIGN`` = 64 elements is a multiple of every SIMD width times
its unrolling: AVX-512 processes 2 × 16 floats per step; CUDA's vectorised loads take 16 bytes).
``tests/test_sharded_optimizer.py`` checks pieces against parameters bit for bit.

Example::

    >>> layout = ShardLayout.of({"a": 100, "b": 10}, num_shards=2)
    >>> layout.offsets, layout.shard_numel, layout.total
    ((0, 128), 128, 256)
    >>> [(p.name, p.start, p.stop, p.flat) for p in layout.pieces(0)]
    [('a', 0, 100, 0)]
    >>> [(p.name, p.start, p.stop, p.flat) for p in layout.pieces(1)]
    [('b', 0, 10, 128)]
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

__all__ = ["ALIGN", "Piece", "ShardLayout", "shard_numel"]

#: Alignment of every parameter and shard boundary in the flat space, in elements (Note
#: [Optimizer shards]).
ALIGN = 64


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


@dataclass(frozen=True)
class Piece:
    """The part of one parameter inside one shard: elements ``[start, stop)`` of the flattened
    parameter, at ``flat`` in the flat space."""

    name: str
    start: int
    stop: int
    flat: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class ShardLayout:
    """The flat space of one stage's parameters cut into ``num_shards`` equal, aligned shards."""

    names: tuple[str, ...]
    numels: tuple[int, ...]
    num_shards: int
    align: int = ALIGN

    @classmethod
    def of(cls, numels: Mapping[str, int], num_shards: int, *, align: int = ALIGN) -> ShardLayout:
        """The layout of parameters ``numels`` (name -> element count, in the stage's order)."""
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1 (got {num_shards})")
        return cls(tuple(numels), tuple(int(n) for n in numels.values()), num_shards, align)

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        """Where each parameter starts in the flat space (multiples of ``align``)."""
        out, pos = [], 0
        for n in self.numels:
            out.append(pos)
            pos += _round_up(n, self.align)
        return tuple(out)

    @cached_property
    def shard_numel(self) -> int:
        """S: elements per shard (the same for every replica; the last may end in padding)."""
        used = self.offsets[-1] + self.numels[-1] if self.numels else 0
        return _round_up(-(-used // self.num_shards), self.align) if used else 0

    @property
    def total(self) -> int:
        """Elements of the flat space, padding included (``num_shards · shard_numel``)."""
        return self.shard_numel * self.num_shards

    def shard_range(self, index: int) -> tuple[int, int]:
        """``[lo, hi)`` of shard ``index`` in the flat space."""
        return index * self.shard_numel, (index + 1) * self.shard_numel

    def pieces(self, index: int) -> list[Piece]:
        """The pieces of shard ``index``, in flat order."""
        lo, hi = self.shard_range(index)
        out = []
        for name, off, n in zip(self.names, self.offsets, self.numels):
            a, b = max(lo, off), min(hi, off + n)
            if a < b:
                out.append(Piece(name, a - off, b - off, a))
        return out

    def param_range(self, name: str) -> tuple[int, int]:
        """``[lo, hi)`` of parameter ``name`` in the flat space."""
        i = self.names.index(name)
        return self.offsets[i], self.offsets[i] + self.numels[i]


def shard_numel(numels: list[int], num_shards: int, align: int = ALIGN) -> int:
    """Elements one replica's shard holds for parameters of ``numels`` elements (the memory
    model's count: :attr:`ShardLayout.shard_numel`).

    >>> shard_numel([100, 10], 2)
    128
    """
    return ShardLayout.of({str(i): n for i, n in enumerate(numels)}, num_shards, align=align).shard_numel
