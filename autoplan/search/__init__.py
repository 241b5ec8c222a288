"""Search: the fastest per-layer plan that fits, with OR-Tools CP-SAT and pruning."""

from .search import SearchResult, SearchSpace, plan, search
from .stage_solver import StageProblem, StageSolution, solve_stage_problem

__all__ = ["plan", "search", "SearchResult", "SearchSpace", "StageProblem", "StageSolution",
           "solve_stage_problem"]
