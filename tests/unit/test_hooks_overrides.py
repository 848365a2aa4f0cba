"""Every method the plugin overrides in a vLLM subclass takes what each supported vLLM version passes: for
every row "overridden in a subclass" (one per version range where the method changed), the plugin's override
in the module the row names accepts the row's parameters (by name, or through ``*args`` and ``**kwargs``)
and requires none beyond them. A row for a newer vLLM in the table is a promise the code keeps."""

from __future__ import annotations

import importlib
import inspect

import pytest

from vllm_contour.integration.vllm_hooks import HOOKS

ROWS = [h for h in HOOKS if h.how.startswith("overridden in a subclass")]
P = inspect.Parameter


def overrides(h):
    """(class, function) of the plugin's overrides of the row's method, in the modules its row names."""
    cls_name, meth = h.symbol.partition(":")[2].split(".")
    found = []
    for where in h.where.split(", "):
        mod = importlib.import_module("vllm_contour." + where.removesuffix(".py").replace("/", "."))
        for obj in vars(mod).values():
            if inspect.isclass(obj) and obj.__module__ == mod.__name__ and meth in vars(obj) and \
                    any(b.__name__ == cls_name for b in obj.__mro__[1:]):
                found.append((obj, vars(obj)[meth]))
    return found


def refusals(fn, params: tuple[str, ...]) -> list[str]:
    """Why ``fn`` cannot be called as vLLM calls a method with ``params`` (empty: it can)."""
    fn = getattr(fn, "__func__", fn)
    ps = list(inspect.signature(fn).parameters.values())
    named = {p.name for p in ps if p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)}
    open_ended = any(p.kind == P.VAR_POSITIONAL for p in ps) and any(p.kind == P.VAR_KEYWORD for p in ps)
    out = [f"does not take {p!r}" for p in params if p not in named and not open_ended]
    out += [f"requires {p.name!r}, which vLLM does not pass" for p in ps
            if p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD) and p.default is P.empty and p.name not in params]
    return out


@pytest.mark.parametrize("h", ROWS, ids=[f"{h.symbol.rsplit('.', 1)[1]}[{h.versions or 'all'}]" for h in ROWS])
def test_the_override_takes_what_vllm_passes(h):
    found = overrides(h)
    assert found, f"{h.symbol}: no override in {h.where}"
    for cls, fn in found:
        assert refusals(fn, h.params) == [], f"{cls.__name__}.{fn.__name__} on vLLM {h.versions or 'any'}"


def test_the_check_tells_a_narrow_override_from_an_open_one():
    def narrow(self, request):
        pass

    def open_(self, request, *args, **kwargs):
        pass

    def greedy(self, request, extra):
        pass

    row = ("self", "request", "max_cache_hit_length")
    assert refusals(narrow, row) == ["does not take 'max_cache_hit_length'"]
    assert refusals(open_, row) == []
    assert refusals(greedy, ("self", "request")) == ["requires 'extra', which vLLM does not pass"]
