"""Selectors: given per-token scores (forced tokens at +inf) and per-head page counts, choose the kept
tokens. One file per method."""

from .balancing import BalancingSelector
from .common import topk_indices
from .diversity import DiversitySelector, normalise_scores
from .topk import TopKSelector

__all__ = ["BalancingSelector", "DiversitySelector", "TopKSelector", "normalise_scores", "topk_indices"]
