"""Allocators: split a layer's head-page budget between its KV heads. One file per method.

Every allocator returns ``[H]`` int64 pages with ``floor <= pages[h] <= region_pages`` and
``sum(pages) == min(total, H * region_pages)`` (never below ``H * floor``). An allocator may also define
``layer_total_pages(base_total, inp)`` (a layer schedule, e.g. PyramidKV).
"""

from .adakv import AdaKVAllocator
from .common import clamp_total, distribute_pages
from .contour import ContourAllocator, dropped_mass, mass_curve, score_mass
from .kvzip import KVzipAllocator
from .pyramid import PyramidAllocator, pyramid_schedule
from .uniform import UniformAllocator

__all__ = ["AdaKVAllocator", "ContourAllocator", "KVzipAllocator", "PyramidAllocator", "UniformAllocator", "clamp_total",
           "distribute_pages", "dropped_mass", "mass_curve", "pyramid_schedule", "score_mass"]
