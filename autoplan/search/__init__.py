"""Search: the fastest per-layer plan that fits, with bounds, OR-Tools CP-SAT and pruning."""

from .replan import plan_diff, replan, reshard_fraction
from .search import WORK_LIMIT, SearchLimit, SearchResult, SearchSpace, plan, search
from .stage_solver import StageProblem, StageSolution, solve_stage_problem

__all__ = ["plan", "replan", "plan_diff", "reshard_fraction", "search", "SearchResult",
           "SearchSpace", "SearchLimit", "WORK_LIMIT", "StageProblem", "StageSolution",
           "solve_stage_problem"]
