r"""The stage-split and per-layer recompute ILP, solved with scipy.optimize.milp (HiGHS). The only solver user.

Data (stages.StageProblem): runs j = 0..J-1 of N_j identical blocks in model order; recompute options
r; stages q = 0..S-1 (S = p v) on ranks rho(q) (StageProblem.stage_rank: q mod p, or a V); per block time t_jr, static bytes w_j,
activation bytes a_jr; rank rho holds f_rho microbatches of activations; pinned first / last layers
add (T_F, W_F, A_F) to stage 0 and (T_L, W_L, A_L) to stage S-1; memory limit M. On heterogeneous
devices t_jr and M are per rank, t_{rho jr} and M_rho (StageProblem.time_on / mem_limit_on).

Variables: n_qjr in Z>=0 (blocks of run j in stage q with option r); b_qj in {0,1} ("run j+1 has
started by stage q"); T >= 0 (the slowest rank's time per microbatch); U >= 0 (the slowest stage).

    minimise    T + eps * sum_qjr t_jr n_qjr + delta U                         (objective, _objective)
    subject to  sum_qr n_qjr = N_j                                    for all j   (_add_run_totals)
                sum_jr n_qjr >= 1                                     for all q   (_add_nonempty)
                C_{j+1}(q) <= N_{j+1} b_qj,  C_j(q) >= N_j b_qj       for q, j<J-1 (_add_order)
                    where C_j(q) = sum_{q'<=q} sum_r n_q'jr (blocks keep model order)
                sum_{q: rho(q)=rho} sum_jr t_jr n_qjr + T_F[rho=0] + T_L[rho=rho(S-1)] <= T
                                                                      for all rho (_add_time)
                sum_{q: rho(q)=rho} sum_jr (w_j + f_rho a_jr) n_qjr + (pinned) <= M
                                                                      for all rho (_add_memory)
                sum_jr t_jr n_qjr + T_F[q=0] + T_L[q=S-1] <= U        for all q, if v > 1 (_add_chunk_time)
delta = 1e-5 when v > 1 (else 0): among equally fast ranks, prefer evenly sized chunks, which the
per-rank pipeline model cannot tell apart but interleaved schedules run better.
Identical blocks are one run, so each kind of layer enters the model once, as counts.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from autoplan.search.stages import StageProblem, StageSolution, evaluate, fits


class _Builder:
    """Rows of a sparse constraint matrix with their bounds."""

    def __init__(self, num_vars: int) -> None:
        self.num_vars = num_vars
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.lb: list[float] = []
        self.ub: list[float] = []

    def add(self, coeffs: dict[int, float], lb: float, ub: float) -> None:
        row = len(self.lb)
        for col, val in coeffs.items():
            self.rows.append(row)
            self.cols.append(col)
            self.vals.append(val)
        self.lb.append(lb)
        self.ub.append(ub)

    def constraint(self) -> Any:
        from scipy.optimize import LinearConstraint  # scipy (0.3 s to import) only when an ILP is solved
        from scipy.sparse import coo_matrix

        a = coo_matrix((self.vals, (self.rows, self.cols)), shape=(len(self.lb), self.num_vars)).tocsr()
        return LinearConstraint(a, np.array(self.lb), np.array(self.ub))


class _Index:
    def __init__(self, problem: StageProblem) -> None:
        self.s, self.j, self.r = problem.num_stages, len(problem.run_sizes), problem.num_options
        self.num_n = self.s * self.j * self.r
        self.num_b = self.s * max(self.j - 1, 0)
        self.t = self.num_n + self.num_b
        self.u = self.t + 1  # the slowest single stage (chunk): a secondary objective when v > 1
        self.num_vars = self.t + 2

    def n(self, q: int, j: int, r: int) -> int:
        return (q * self.j + j) * self.r + r

    def b(self, q: int, j: int) -> int:
        return self.num_n + q * (self.j - 1) + j


def _add_run_totals(m: _Builder, ix: _Index, problem: StageProblem) -> None:
    for j, size in enumerate(problem.run_sizes):
        m.add({ix.n(q, j, r): 1.0 for q in range(ix.s) for r in range(ix.r)}, size, size)


def _add_nonempty(m: _Builder, ix: _Index) -> None:
    for q in range(ix.s):
        m.add({ix.n(q, j, r): 1.0 for j in range(ix.j) for r in range(ix.r)}, 1, np.inf)


def _add_order(m: _Builder, ix: _Index, problem: StageProblem) -> None:
    for q in range(ix.s):
        for j in range(ix.j - 1):
            nxt = {ix.n(qq, j + 1, r): 1.0 for qq in range(q + 1) for r in range(ix.r)}
            m.add({**nxt, ix.b(q, j): -float(problem.run_sizes[j + 1])}, -np.inf, 0.0)
            cur = {ix.n(qq, j, r): -1.0 for qq in range(q + 1) for r in range(ix.r)}
            m.add({**cur, ix.b(q, j): float(problem.run_sizes[j])}, -np.inf, 0.0)


def _pinned(problem: StageProblem, rank: int) -> tuple[float, float]:
    """(time, bytes) of the pinned first / last layers on this rank."""
    t = m = 0.0
    f = problem.inflight[rank]
    if rank == problem.stage_rank[0]:
        t += problem.first_time_s
        m += problem.first_static_bytes + f * problem.first_act_bytes
    if rank == problem.stage_rank[-1]:
        t += problem.last_time_s
        m += problem.last_static_bytes + f * problem.last_act_bytes
    return t, m


def _stages_of(problem: StageProblem, rank: int) -> list[int]:
    return [q for q, r in enumerate(problem.stage_rank) if r == rank]


def _add_time(m: _Builder, ix: _Index, problem: StageProblem, scale: float) -> None:
    for rank in range(problem.num_ranks):
        times = problem.time_on(rank)
        coeffs = {ix.n(q, j, r): times[j][r] / scale
                  for q in _stages_of(problem, rank) for j in range(ix.j) for r in range(ix.r)}
        coeffs[ix.t] = -1.0
        m.add(coeffs, -np.inf, -_pinned(problem, rank)[0] / scale)


def _add_chunk_time(m: _Builder, ix: _Index, problem: StageProblem, scale: float) -> None:
    for q in range(ix.s):
        times = problem.time_on(problem.stage_rank[q])
        coeffs = {ix.n(q, j, r): times[j][r] / scale for j in range(ix.j) for r in range(ix.r)}
        coeffs[ix.u] = -1.0
        pinned = (problem.first_time_s if q == 0 else 0.0) + (problem.last_time_s if q == ix.s - 1 else 0.0)
        m.add(coeffs, -np.inf, -pinned / scale)


def _add_memory(m: _Builder, ix: _Index, problem: StageProblem) -> None:
    for rank in range(problem.num_ranks):
        limit = problem.mem_limit_on(rank)
        f = problem.inflight[rank]
        coeffs = {ix.n(q, j, r): (problem.static_bytes[j] + f * problem.act_bytes[j][r]) / limit
                  for q in _stages_of(problem, rank) for j in range(ix.j) for r in range(ix.r)}
        m.add(coeffs, -np.inf, 1.0 - _pinned(problem, rank)[1] / limit)


def _objective(ix: _Index, problem: StageProblem, scale: float) -> np.ndarray:
    c = np.zeros(ix.num_vars)
    c[ix.t] = 1.0
    c[ix.u] = 1e-5 if problem.virtual_stages > 1 else 0.0  # balanced chunks, among equally fast ranks
    eps = 1e-4 / max(ix.s, 1)  # tie-break: among equally slow splits, the least total work
    for q in range(ix.s):
        for j in range(ix.j):
            for r in range(ix.r):
                c[ix.n(q, j, r)] = eps * problem.time_on(problem.stage_rank[q])[j][r] / scale
    return c


# HiGHS's work limit: branch-and-bound nodes, not seconds, so that the same problem gets the same answer on an
# idle and on a loaded machine. The search calls the ILP only for three or more runs of blocks with several
# chunks per rank (balance.py solves one or two runs exactly, the DP v = 1); on deepseek-v3's two-run problems
# HiGHS's root node alone (node_limit 1) already reached the optimum in 4 of 4 cases, at 1-2 s each.
NODE_LIMIT = 200


def solve_ilp(problem: StageProblem, *, node_limit: int = NODE_LIMIT) -> StageSolution | None:
    """The optimal split and recompute counts (the best found within `node_limit` branch-and-bound nodes),
    or None when no split fits; RuntimeError when the solver stops at the node limit without any solution."""
    ix = _Index(problem)
    scale = max(max(max(row) for rank in range(problem.num_ranks) for row in problem.time_on(rank)), 1e-30)
    builder = _Builder(ix.num_vars)
    _add_run_totals(builder, ix, problem)
    _add_nonempty(builder, ix)
    if any(np.isfinite(problem.mem_limit_on(r)) for r in range(problem.num_ranks)):
        _add_memory(builder, ix, problem)
    _add_order(builder, ix, problem)
    _add_time(builder, ix, problem, scale)
    if problem.virtual_stages > 1:
        _add_chunk_time(builder, ix, problem, scale)
    from scipy.optimize import Bounds, milp

    integrality = np.ones(ix.num_vars)
    integrality[ix.t:] = 0
    upper = np.full(ix.num_vars, np.inf)
    upper[ix.num_n:ix.t] = 1.0
    res = milp(_objective(ix, problem, scale), constraints=[builder.constraint()], integrality=integrality,
               bounds=Bounds(np.zeros(ix.num_vars), upper),
               options={"node_limit": node_limit, "mip_rel_gap": 1e-5})
    if res.x is None:
        if res.status == 2:  # proven infeasible: no split fits
            return None
        raise RuntimeError(f"HiGHS found no solution: {res.message}")
    n = np.rint(res.x[:ix.num_n]).astype(np.int64).reshape(ix.s, ix.j, ix.r)
    try:
        solution = evaluate(problem, tuple(tuple(tuple(int(x) for x in run) for run in st) for st in n.tolist()),
                            method="ilp")
    except ValueError:
        return None
    return solution if fits(problem, solution) else None
