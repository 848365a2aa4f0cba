"""Scorers: per (head, token) importance of the compactable region ``[H, region_len]``. Higher = keep.
One file per method."""

from .common import avg_pool, gqa_mean, window_attention, window_mass, window_queries
from .expected_attention import ExpectedAttentionScorer
from .h2o import H2OScorer
from .keydiff import KeyDiffScorer
from .knorm import KeyNormScorer
from .kvzap import KVzapScorer, SurrogateNet, unrope
from .kvzip import KVzipScorer, reconstruction_max
from .moment import MomentScorer
from .recency import RecencyScorer
from .snapkv import SnapKVScorer
from .tova import TOVAScorer

__all__ = ["avg_pool", "gqa_mean", "window_attention", "window_mass", "window_queries",
           "ExpectedAttentionScorer", "H2OScorer", "KeyDiffScorer", "KeyNormScorer", "KVzapScorer", "KVzipScorer",
           "MomentScorer", "RecencyScorer", "SnapKVScorer", "SurrogateNet", "TOVAScorer", "reconstruction_max",
           "unrope"]
