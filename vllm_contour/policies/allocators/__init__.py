"""Allocators: split a layer's head-page budget between its KV heads. One file per method.

Every allocator returns ``[H]`` int64 pages with ``floor <= pages[h] <= region_pages`` and
``sum(pages) == min(total, H * region_pages)`` (never below ``H * floor``). Each subclasses ``base.Allocator``,
which declares the optional parts with defaults: a layer schedule (``layer_total_pages``: PyramidKV) and
``candidates_only`` (a split that ignores the scores: ``allocate_groups`` splits many layers at once).
"""

from .adakv import AdaKVAllocator
from .common import clamp_total, distribute_pages
from .contour import ContourAllocator, dropped_mass, mass_curve, score_mass
from .kvzip import KVzipAllocator
from .pyramid import PyramidAllocator, pyramid_schedule
from .uniform import UniformAllocator

__all__ = ["AdaKVAllocator", "ContourAllocator", "KVzipAllocator", "PyramidAllocator", "UniformAllocator", "clamp_total",
           "distribute_pages", "dropped_mass", "mass_curve", "pyramid_schedule", "score_mass"]
