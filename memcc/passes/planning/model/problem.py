"""The array form of a memory-planning problem that every solver works on.

Time is the step's schedule (one point per node of the original order); ``base[t]`` is the
bytes live at point ``t`` when nothing is changed. A problem has variables of several kinds:

- decision variables (binary), each belonging to one decision kind (``recompute`` today;
  ``offload`` and ``variant`` plug in the same way) and carrying the seconds it adds;
- auxiliary variables (continuous in [0, 1]) that a term generator uses to stay linear,
  e.g. "this buffer is still alive at point p", each bounded from below by ``floors``
  (aux >= sum(coef * var) + const). Memory rows only ever push them down, so at an optimum
  they equal the largest floor; ``settle`` computes exactly that for any decision vector.

Memory is a sum of interval terms: ``term_bytes`` (signed) times a variable's value, over
``[term_start, term_end]``. ``choice_groups`` are one-of-k groups (at most one variable of a
group is set: "recompute this node at one of these points, or not at all"), and ``rows`` are
further linear constraints ``sum(coef * var) <= ub``. Term generators build problems through
``ProblemBuilder``; solvers read only these arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

BINARY = "binary"
CONTINUOUS = "continuous"


@dataclass(frozen=True)
class SparseRows:
    """Rows of a sparse matrix in CSR form, each with a right-hand side."""

    ptr: np.ndarray    # int64[r + 1]
    var: np.ndarray    # int64[nnz]
    coef: np.ndarray   # float64[nnz]
    rhs: np.ndarray    # float64[r]

    @property
    def count(self) -> int:
        return len(self.rhs)

    def row(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = int(self.ptr[k]), int(self.ptr[k + 1])
        return self.var[a:b], self.coef[a:b]

    def evaluate(self, values: np.ndarray) -> np.ndarray:
        """sum(coef * var) of every row for ``values``."""
        out = np.zeros(self.count)
        if self.count:
            rows = np.repeat(np.arange(self.count), np.diff(self.ptr))
            np.add.at(out, rows, self.coef * values[self.var])
        return out

    @staticmethod
    def empty() -> SparseRows:
        return SparseRows(np.zeros(1, np.int64), np.zeros(0, np.int64), np.zeros(0),
                          np.zeros(0))


@dataclass(frozen=True)
class Problem:
    base: np.ndarray        # float64[T]: bytes live at each time point with nothing changed
    cost: np.ndarray        # float64[n]: added seconds when variable i is set
    var_type: tuple[str, ...]   # BINARY or CONTINUOUS per variable
    kind: tuple[str, ...]       # decision kind per variable ("recompute", "alive", ...)
    names: tuple[str, ...]      # per variable, for messages and debugging
    term_var: np.ndarray    # int64[m]
    term_bytes: np.ndarray  # float64[m], signed
    term_start: np.ndarray  # int64[m], inclusive
    term_end: np.ndarray    # int64[m], inclusive
    choice_groups: tuple[np.ndarray, ...] = ()
    rows: SparseRows = field(default_factory=SparseRows.empty)      # sum <= rhs
    floors: SparseRows = field(default_factory=SparseRows.empty)    # aux >= sum + rhs
    floor_aux: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    # Tie-breaks between answers of equal cost, in [0, 1] per variable (smaller preferred),
    # e.g. a clone born later: the lowering makes it as late as it can, so the model should.
    preference: np.ndarray | None = None

    @property
    def n_vars(self) -> int:
        return len(self.cost)

    @property
    def horizon(self) -> int:
        return len(self.base)

    @property
    def binary(self) -> np.ndarray:
        return np.array([t == BINARY for t in self.var_type], dtype=bool)

    def settle(self, values: np.ndarray, *, relaxed: bool = False) -> np.ndarray:
        """``values`` with binaries rounded and every auxiliary variable at its largest floor
        (what the memory rows would force it to if every row were in the model).
        ``relaxed`` keeps fractional binaries (an LP relaxation's answer)."""
        v = np.asarray(values, dtype=np.float64).copy()
        binary = self.binary
        v[binary] = np.clip(v[binary], 0.0, 1.0) if relaxed else np.round(v[binary])
        aux = ~binary
        v[aux] = 0.0
        if self.floors.count:
            lower = self.floors.evaluate(v) + self.floors.rhs
            np.maximum.at(v, self.floor_aux, lower)
            v[aux] = np.clip(v[aux], 0.0, 1.0)
        return v

    def memory(self, values: np.ndarray) -> np.ndarray:
        """Modelled bytes live at every time point for settled ``values``."""
        diff = np.zeros(self.horizon + 1)
        w = self.term_bytes * np.asarray(values, dtype=np.float64)[self.term_var]
        np.add.at(diff, self.term_start, w)
        np.add.at(diff, self.term_end + 1, -w)
        return self.base + np.cumsum(diff[:-1])

    def peak(self, values: np.ndarray) -> float:
        return float(self.memory(self.settle(values)).max(initial=0.0))

    def added_time(self, values: np.ndarray) -> float:
        return float(self.cost @ np.asarray(values, dtype=np.float64))

    def memory_row(self, t: int) -> dict[int, float]:
        """Coefficients of the memory constraint at time ``t`` (variable -> bytes)."""
        mask = (self.term_start <= t) & (t <= self.term_end)
        coeffs: dict[int, float] = {}
        for v, b in zip(self.term_var[mask], self.term_bytes[mask], strict=True):
            coeffs[int(v)] = coeffs.get(int(v), 0.0) + float(b)
        return coeffs

    def feasible(self, values: np.ndarray, tol: float = 1e-6) -> bool:
        """Whether settled ``values`` satisfy the choice groups and the rows."""
        v = np.asarray(values, dtype=np.float64)
        if any(v[g].sum() > 1 + tol for g in self.choice_groups):
            return False
        return bool(np.all(self.rows.evaluate(v) <= self.rows.rhs + tol))


class ProblemBuilder:
    """Collects variables, terms and constraints from one or more term generators."""

    def __init__(self, base: np.ndarray) -> None:
        self.base = np.asarray(base, dtype=np.float64)
        self._cost: list[float] = []
        self._type: list[str] = []
        self._kind: list[str] = []
        self._names: list[str] = []
        self._preference: list[float] = []
        self._terms: tuple[list, list, list, list] = ([], [], [], [])
        self._groups: list[np.ndarray] = []
        self._rows: tuple[list, list, list] = ([0], [], [])
        self._rows_rhs: list[float] = []
        self._floors: tuple[list, list, list] = ([0], [], [])
        self._floors_rhs: list[float] = []
        self._floor_aux: list[int] = []

    @property
    def horizon(self) -> int:
        return len(self.base)

    def variable(self, kind: str, name: str, cost: float = 0.0, *,
                 var_type: str = BINARY, preference: float = 0.0) -> int:
        self._preference.append(float(preference))
        self._cost.append(float(cost))
        self._type.append(var_type)
        self._kind.append(kind)
        self._names.append(name)
        return len(self._cost) - 1

    def term(self, var: int, nbytes: float, start: int, end: int) -> None:
        """``nbytes * var`` live over ``[start, end]`` (clipped to the schedule)."""
        start, end = max(int(start), 0), min(int(end), self.horizon - 1)
        if nbytes and start <= end:
            for lst, x in zip(self._terms, (var, float(nbytes), start, end), strict=True):
                lst.append(x)

    def choice(self, variables: list[int]) -> None:
        if len(variables) > 1:
            self._groups.append(np.asarray(variables, dtype=np.int64))

    def row(self, coeffs: dict[int, float], rhs: float) -> None:
        _append(self._rows, coeffs)
        self._rows_rhs.append(float(rhs))

    def floor(self, aux: int, coeffs: dict[int, float], const: float = 0.0) -> None:
        _append(self._floors, coeffs)
        self._floors_rhs.append(float(const))
        self._floor_aux.append(aux)

    def build(self) -> Problem:
        tv, tb, ts, te = self._terms
        return Problem(
            base=self.base,
            cost=np.asarray(self._cost, dtype=np.float64),
            var_type=tuple(self._type),
            kind=tuple(self._kind),
            names=tuple(self._names),
            term_var=np.asarray(tv, dtype=np.int64),
            term_bytes=np.asarray(tb, dtype=np.float64),
            term_start=np.asarray(ts, dtype=np.int64),
            term_end=np.asarray(te, dtype=np.int64),
            choice_groups=tuple(self._groups),
            rows=_sparse(self._rows, self._rows_rhs),
            floors=_sparse(self._floors, self._floors_rhs),
            floor_aux=np.asarray(self._floor_aux, dtype=np.int64),
            preference=np.asarray(self._preference, dtype=np.float64),
        )


def _append(store: tuple[list, list, list], coeffs: dict[int, float]) -> None:
    ptr, var, coef = store
    for v, c in coeffs.items():
        if c:
            var.append(int(v))
            coef.append(float(c))
    ptr.append(len(var))


def _sparse(store: tuple[list, list, list], rhs: list[float]) -> SparseRows:
    ptr, var, coef = store
    return SparseRows(np.asarray(ptr, dtype=np.int64), np.asarray(var, dtype=np.int64),
                      np.asarray(coef, dtype=np.float64), np.asarray(rhs, dtype=np.float64))


@dataclass(frozen=True)
class Solution:
    x: np.ndarray           # float64[n], settled (binaries 0/1, auxiliaries at their floors)
    status: str             # "optimal", "feasible" (work or time limit with incumbent), ...
    gap: float | None       # relative optimality gap reported by the solver
    objective: float        # modelled added seconds
    solve_time_s: float
    solver: str
    iterations: int = 1
    limit_hit: str | None = None  # "work" or "time" when the search stopped at a limit
    rows: tuple[int, ...] = ()    # the time points whose memory rows the model ended with
