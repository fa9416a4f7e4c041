"""Pricing the quick estimate's collectives once per distinct (group placement, message size).

search/assemble.py asks for the time of a collective for every candidate (and pipeline rank) at once. Most
of those are the same question many times over: the message sizes of a candidate come from its layer-table
row (search/surrogate.py), which it shares with every candidate of the same (tp, cp, ep, sp, microbatch,
recompute, etp, eep) and pipeline shape, and only the ZeRO stage and the schedule tell them apart. So:

- `Mesh` (what collectives.mesh_sizes returns) holds the candidates' mesh degrees and a class per candidate
  (the layer-table key, else the mesh itself): `price_rows` prices one representative row of each class and
  checks, element by element, that every other row of the class asks the same question; rows that do not
  are priced on their own. The answer is the same as pricing every row (a test): the check is exact.
- `Pricing.prices` keeps every price computed during one quick estimate, keyed by the collective and its
  axes, the mesh and the message size in bytes (and each group placement, by axes and mesh), so a question
  asked again by another pipeline shape costs a dictionary look-up.
Each price is the cost model's own function called on the same (bytes, placement, cluster): bit for bit
what pricing each candidate directly gives.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

# numpy.ma: np.unique's first plain call imports it (numpy/lib/_arraysetops_impl.py, _unique1d); imported with
# the search (while a cold preset is captured, graph/named.py), not once in each quick-estimate piece
import numpy as np
import numpy.ma

from autoplan.plan.types import ParallelConfig

MESH_COLS = ("pp", "dp", "ep", "cp", "tp", "etp", "eep")  # the columns of Mesh.sizes, in this order


@dataclass(frozen=True, slots=True)
class Pricing:
    """What the collectives of one quick estimate share: the prices computed so far, and (for the
    candidates being assembled) a class per candidate whose members usually ask the same questions."""

    prices: dict[tuple, float] = field(default_factory=dict)
    classes: np.ndarray | None = None


@dataclass(frozen=True, slots=True, eq=False)
class Mesh:
    """Mesh degrees [n, 7] per candidate (MESH_COLS), their classes (each of one mesh), a representative row
    of each class, and the distinct meshes."""

    sizes: np.ndarray
    reps: np.ndarray  # a row of each class
    inverse: np.ndarray  # each row's class
    class_mesh: np.ndarray  # each class's index in `meshes`
    meshes: tuple[tuple[int, ...], ...]  # the distinct meshes
    prices: dict[tuple, Any]
    groups: dict[tuple, Any] = field(default_factory=dict)  # (axes tag, index in meshes) -> its group placement

    @staticmethod
    def of(sizes: np.ndarray, pricing: Pricing | None = None) -> Mesh:
        """The mesh of `sizes` [n, 7], classed by pricing.classes where every class holds one mesh (checked;
        else by the classes and the mesh together), else by the mesh."""
        sizes = np.asarray(sizes)
        given = pricing is not None and pricing.classes is not None
        _, reps, inverse = np.unique(pricing.classes if given else int_codes(*sizes.T), return_index=True,
                                     return_inverse=True)
        inverse = inverse.reshape(-1)
        if given and not (sizes[reps][inverse] == sizes).all():
            _, reps, inverse = np.unique(int_codes(pricing.classes, *sizes.T), return_index=True,
                                         return_inverse=True)
            inverse = inverse.reshape(-1)
        _, first, class_mesh = np.unique(int_codes(*sizes[reps].T), return_index=True, return_inverse=True)
        return Mesh(sizes=sizes, reps=reps, inverse=inverse, class_mesh=class_mesh.reshape(-1),
                    meshes=tuple(tuple(int(x) for x in row) for row in sizes[reps][first].tolist()),
                    prices=pricing.prices if pricing is not None else {})

    def __len__(self) -> int:
        return len(self.sizes)

    def uniform(self, *arrays: np.ndarray) -> bool:
        """Whether every row of each array ([n] or [n, p]) equals its class representative's: then a value
        computed per class (price_classes) and spread to the rows is the value computed per row."""
        return all(bool((a[self.reps][self.inverse] == a).all()) for a in arrays)


def int_codes(*columns: np.ndarray) -> np.ndarray:
    """One integer per distinct row of the non-negative integer columns: mixed radix (column maximum + 1)
    when the codes fit in int64, else each column ranked first (a sort per column)."""
    cols = [np.asarray(c, dtype=np.int64).reshape(-1) for c in columns]
    radix = [int(c.max(initial=0)) + 1 for c in cols]
    if all(int(c.min(initial=0)) >= 0 for c in cols) and np.prod([float(r) for r in radix]) < 2.0**62:
        code = np.zeros(len(cols[0]), dtype=np.int64)
        for col, r in zip(cols, radix):
            code = code * r + col
        return code
    code = np.zeros(len(cols[0]), dtype=np.int64)
    for col in cols:
        values, rank = np.unique(col, return_inverse=True)
        code = code * len(values) + rank.reshape(-1)
    return code


def per_mesh(mesh: Mesh, fn: Callable[[ParallelConfig], float], tag: Hashable = None) -> np.ndarray:
    """fn(config of the mesh) per candidate, once per distinct mesh; with a `tag` (naming fn), once per
    quick estimate: kept in mesh.prices under (tag, mesh row), as every chunk and pipeline shape asks again."""
    if tag is None:
        values = np.array([fn(config_of(row)) for row in mesh.meshes])
        return values[mesh.class_mesh][mesh.inverse]
    memo, out = mesh.prices, []
    for row in mesh.meshes:
        value = memo.get((tag, row))
        if value is None:
            value = memo[tag, row] = fn(config_of(row))
        out.append(value)
    return np.array(out)[mesh.class_mesh][mesh.inverse]


@lru_cache(maxsize=4096)
def config_of(mesh: tuple[int, ...]) -> ParallelConfig:
    """The (validated, frozen) ParallelConfig of a mesh row, made once per distinct row."""
    pp, dp, ep, cp, tp, etp, eep = mesh
    return ParallelConfig(pp=pp, dp=dp, ep=ep, cp=cp, tp=tp, etp=etp, eep=eep)


def price_rows(mesh: Mesh, values: np.ndarray, place: Callable[[tuple[int, ...]], Hashable],
               fn: Callable[[float, Any], float], tags: tuple[Hashable, Hashable], skip_nonpositive: bool = True
               ) -> np.ndarray:
    """fn(value, place(mesh row)) for every element of `values` ([n] or [n, p], one row per candidate of
    `mesh`), each distinct question once: per class its representative's row, then any row that differs
    from its representative on its own. Kept in mesh.prices: each group, under ("group", tags[0], mesh row),
    and each price, under (tags[1], group, value), so meshes with one placement share their prices. Values
    <= 0 price 0 when `skip_nonpositive` (nothing to send)."""
    values = np.asarray(values, dtype=float)
    flat = values.reshape(len(values), -1)
    if skip_nonpositive and (flat <= 0).all():  # nothing to send anywhere (a dense model's experts)
        return np.zeros(values.shape)
    sub = flat[mesh.reps]
    out = _price_distinct(mesh, mesh.class_mesh, sub, place, fn, tags, skip_nonpositive)[mesh.inverse]
    odd = np.nonzero(~(sub[mesh.inverse] == flat).all(axis=1))[0]
    if len(odd):
        out[odd] = _price_distinct(mesh, mesh.class_mesh[mesh.inverse[odd]], flat[odd], place, fn, tags,
                                   skip_nonpositive)
    return out.reshape(values.shape)


def price_classes(mesh: Mesh, values: np.ndarray, place: Callable[[tuple[int, ...]], Hashable],
                  fn: Callable[[float, Any], float], tags: tuple[Hashable, Hashable], skip_nonpositive: bool = True
                  ) -> np.ndarray:
    """price_rows for values given per class of `mesh` ([classes] or [classes, p]; every row of a class asks
    its class's question, see Mesh.uniform), per class: price_rows' representatives' prices, without
    spreading them to the rows and checking each row against its representative."""
    values = np.asarray(values, dtype=float)
    flat = values.reshape(len(values), -1)
    if skip_nonpositive and (flat <= 0).all():
        return np.zeros(values.shape)
    return _price_distinct(mesh, mesh.class_mesh, flat, place, fn, tags, skip_nonpositive).reshape(values.shape)


def _price_distinct(mesh: Mesh, mesh_of: np.ndarray, values: np.ndarray, place: Callable[[tuple[int, ...]], Hashable],
                    fn: Callable[[float, Any], float], tags: tuple[Hashable, Hashable],
                    skip_nonpositive: bool) -> np.ndarray:
    """fn(value, group of its row's mesh) for each element of values [m, p] (row i's mesh is
    mesh.meshes[mesh_of[i]]), each distinct (mesh, value) looked up once, each price computed once per
    quick estimate (mesh.prices)."""
    ms, bs, inverse = _distinct_pairs(mesh_of, values, len(mesh.meshes))
    memo, meshes, groups = mesh.prices, mesh.meshes, mesh.groups
    out = np.zeros(len(ms))
    for i, (m, b) in enumerate(zip(ms, bs)):
        if skip_nonpositive and b <= 0:
            continue
        group = groups.get((tags[0], m))
        if group is None:
            group = groups[tags[0], m] = _memo(memo, ("group", tags[0], meshes[m]), lambda m=m: place(meshes[m]))
        key = (tags[1], group, b)
        value = memo.get(key)
        if value is None:
            value = memo[key] = fn(b, group)
        out[i] = value
    return out[inverse.reshape(-1)].reshape(values.shape)


def _distinct_pairs(mesh_of: np.ndarray, values: np.ndarray, meshes: int) -> tuple[list[int], list[float], np.ndarray]:
    """The distinct (mesh index, value) pairs of values [m, p] (row i's mesh mesh_of[i]), ascending, and
    each element's pair: one unique of mesh * radix + value when the values are whole numbers of bytes
    (collectives price rounded sizes), else one of the values and one of the pairs of ranks."""
    per, flat = values.shape[1], values.reshape(-1)
    rows = np.repeat(mesh_of.astype(np.int64), per)
    top = float(flat.max(initial=0.0))
    if flat.size and flat.min() >= 0 and top < 2.0**52 / max(meshes, 1) and (flat == np.floor(flat)).all():
        radix = int(top) + 1
        pairs, inverse = np.unique(rows * radix + flat.astype(np.int64), return_inverse=True)
        return (pairs // radix).tolist(), (pairs % radix).astype(float).tolist(), inverse.reshape(-1)
    distinct, rank = np.unique(flat, return_inverse=True)
    pairs, inverse = np.unique(rows * len(distinct) + rank.reshape(-1), return_inverse=True)
    return (pairs // len(distinct)).tolist(), distinct[pairs % len(distinct)].tolist(), inverse.reshape(-1)


def _memo(memo: dict[tuple, Any], key: tuple, make: Callable[[], Any]) -> Any:
    found = memo.get(key)
    if found is None:
        found = memo[key] = make()
    return found
