"""The table of places the plugin hooks into vLLM (``integration/vllm_hooks.py``) matches the installed
vLLM, and a hook whose symbol disappears or whose parameters change is reported by name (a server with
eviction on then refuses to start) and is not installed; rows are picked by vLLM version; the source check
reads a vLLM tree without importing it and agrees with the run-time check; every patch and instance wrap in
the package goes through the table, and each row names the module that installs it."""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

import pytest

from vllm_contour.config import EvictionConfigError
from vllm_contour.integration import vllm_hooks
from vllm_contour.integration.vllm_hooks import HOOKS, Hook

PKG = Path(__file__).resolve().parents[2] / "vllm_contour"
VERSIONS = ("0.32.0", "0.33.0", "0.34.0")


@pytest.fixture
def fresh(monkeypatch):
    """An empty record of hooks not installed (the process's own record is restored after the test)."""
    monkeypatch.setattr(vllm_hooks, "NOT_INSTALLED", {})
    return vllm_hooks.NOT_INSTALLED


def test_every_hook_matches_the_installed_vllm_before_and_after_the_plugin_patches():
    assert vllm_hooks.check() == []
    import vllm_contour

    vllm_contour.register()
    assert vllm_hooks.check() == []  # patched symbols are checked through the original they wrap
    vllm_hooks.require()


def test_a_changed_or_missing_hook_is_named(monkeypatch):
    from vllm.v1.core.sched.scheduler import Scheduler

    def changed(self, request, num_computed_tokens, num_new_tokens, extra):
        return num_new_tokens

    monkeypatch.setattr(Scheduler, "_reserve_prefill_lookahead", changed)
    problems = vllm_hooks.check()
    assert len(problems) == 1 and problems[0].startswith(
        "vllm.v1.core.sched.scheduler:Scheduler._reserve_prefill_lookahead: parameters")
    with pytest.raises(EvictionConfigError, match=r"vLLM 0\.32\.0.*_reserve_prefill_lookahead.*extra"):
        vllm_hooks.require()
    monkeypatch.delattr(Scheduler, "_reserve_prefill_lookahead")
    assert "AttributeError" in vllm_hooks.check()[0]
    gone = Hook("vllm.v1.core.block_pool:BlockPool.no_such_thing", None, "written", "-", "-")
    assert "no_such_thing" in vllm_hooks.check((gone,))[0]


def test_a_class_row_needs_its_fields_and_an_instance_attribute_its_init():
    from vllm.v1.attention.backends import cpu_attn

    ok = Hook("vllm.v1.attention.backends.cpu_attn:CPUAttentionMetadata", ("num_actual_tokens",), "-", "-", "-")
    lost = Hook("vllm.v1.attention.backends.cpu_attn:CPUAttentionMetadata", ("num_actual_tokens", "gone_field"),
                "-", "-", "-")
    not_dc = Hook("vllm.v1.attention.backends.cpu_attn:CPUAttentionBackend", ("x",), "-", "-", "-")
    attr = Hook("vllm.v1.core.single_type_kv_cache_manager:SingleTypeKVCacheManager.no_attr", None, "-", "-", "-")
    assert cpu_attn.CPUAttentionMetadata and vllm_hooks.check((ok,)) == []
    assert "('gone_field',) gone" in vllm_hooks.check((lost,))[0]
    assert "no longer a dataclass" in vllm_hooks.check((not_dc,))[0]
    assert "no longer set in SingleTypeKVCacheManager.__init__" in vllm_hooks.check((attr,))[0]


def test_a_server_with_eviction_refuses_a_vllm_whose_hooks_changed(monkeypatch, fresh):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_contour.integration.frontend.engine_args import prepare_engine_args

    monkeypatch.setattr(vllm_hooks, "_problems", lambda hooks=None, version=None, features=None: {"x:Y.z": "x:Y.z: parameters ('a',)"})
    with pytest.raises(EvictionConfigError, match=r"--kv-eviction-policy.*vLLM 0\.32\.0.*x:Y\.z"):
        prepare_engine_args(EngineArgs(model="dummy", additional_config={"kv_eviction": {"policy": "snapkv"}}))
    prepare_engine_args(EngineArgs(model="dummy"))  # eviction off: nothing checked


def test_a_hook_that_could_not_be_installed_refuses_eviction_naming_it(fresh):
    vllm_hooks.not_installed("vllm.v1.attention.backends.registry:register_backend", "ImportError: boom")
    with pytest.raises(EvictionConfigError, match=r"vLLM 0\.32\.0.*register_backend: ImportError: boom"):
        vllm_hooks.require()


# ------------------------------------------------------------------------------------------ versions
def test_rows_are_picked_by_version_on_its_release():
    row = Hook("m:f", (), "-", "-", "-", versions=">=0.34")
    assert vllm_hooks.applies(row, "0.34.0rc1") and vllm_hooks.applies(row, "0.34.1.dev3+gabc")
    assert not vllm_hooks.applies(row, "0.33.0+cpu")
    assert vllm_hooks.applies(Hook("m:f", (), "-", "-", "-"), "0.1.0")


@pytest.mark.parametrize("version", VERSIONS)
def test_each_row_has_at_most_one_alternative_per_version(version):
    keys = [h.key for h in vllm_hooks.rows_for(version)]
    assert len(keys) == len(set(keys))
    for h in HOOKS:  # an alternative names an existing first row
        assert h.name == "" or any(g.symbol == h.name and g.name == "" for g in HOOKS), h


def test_a_moved_symbol_is_found_through_its_first_rows_name(monkeypatch):
    name = "vllm._custom_ops:cpu_attn_reshape_and_cache"
    assert vllm_hooks.hook(name).symbol == name
    from vllm import _custom_ops

    assert vllm_hooks.resolve(name) is _custom_ops.cpu_attn_reshape_and_cache
    monkeypatch.setattr(vllm_hooks, "installed_version", lambda: "0.34.0")
    assert vllm_hooks.hook(name).symbol == "vllm._cpu_ops:cpu_attn_reshape_and_cache"
    import dataclasses

    only_old = dataclasses.replace(vllm_hooks.HOOKS[0], symbol="vllm.envs:GONE_IN_034", versions="<0.34")
    monkeypatch.setattr(vllm_hooks, "HOOKS", vllm_hooks.HOOKS + (only_old,))
    with pytest.raises(KeyError, match="no row .* applies to vLLM 0.34.0"):
        vllm_hooks.hook("vllm.envs:GONE_IN_034")
    with pytest.raises(KeyError, match="not a declared hook"):
        vllm_hooks.hook("vllm.x:Undeclared.attr")


# ------------------------------------------------------------------------------------ installation
def test_a_hook_whose_check_fails_is_not_installed(monkeypatch, fresh):
    from vllm.v1.core.sched.scheduler import Scheduler

    def changed(self, request, extra):
        return 0

    symbol = "vllm.v1.core.sched.scheduler:Scheduler._reserve_prefill_lookahead"
    monkeypatch.setattr(Scheduler, "_reserve_prefill_lookahead", changed)
    assert vllm_hooks.patch_class(symbol, lambda orig: (lambda self, *a: 1)) is False
    assert Scheduler._reserve_prefill_lookahead is changed and "parameters" in fresh[symbol]

    class Obj:
        def _reserve_prefill_lookahead(self, request, extra):
            return 0

    obj = Obj()
    assert vllm_hooks.wrap_instance(obj, symbol, lambda bound: (lambda *a: 1)) is False
    assert obj._reserve_prefill_lookahead(None, None) == 0
    with pytest.raises(EvictionConfigError, match="_reserve_prefill_lookahead"):
        vllm_hooks.require()


def test_a_hook_is_installed_once_and_checked_through_its_original(monkeypatch, fresh):
    from vllm.v1.core.block_pool import BlockPool

    symbol = "vllm.v1.core.block_pool:BlockPool.touch"
    stock = BlockPool.touch
    monkeypatch.setattr(BlockPool, "touch", stock)  # restored after the test
    made = []

    def make(orig):
        made.append(orig)

        def touch(self, blocks):
            return orig(self, blocks)

        return touch

    assert vllm_hooks.patch_class(symbol, make) and vllm_hooks.patch_class(symbol, make)
    assert len(made) == 1 and BlockPool.touch.__contour_original__ is stock
    assert vllm_hooks.check() == [] and fresh == {}


# ----------------------------------------------------------------------------------- source check
def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(textwrap.dedent(text))
    return root


FAKE = {
    "vllm/__init__.py": "",
    "vllm/_version.py": "__version__ = version = '0.34.0'\n__version_tuple__ = (0, 34, 0)\n",
    "vllm/core/__init__.py": "from .impl import exported, Base as Renamed\n",
    "vllm/core/impl.py": """
        from dataclasses import dataclass
        from typing import ClassVar, overload

        def exported(a, b=1, *rest, key, **kw): ...

        @dataclass
        class Base:
            first: int
            kind: ClassVar[str] = "x"

            def __init__(self, pool):
                self.pool = pool

            def inherited(self, x): ...
        """,
    "vllm/sched.py": """
        from vllm.core.impl import Base

        try:
            from vllm.core import exported as again
        except ImportError:
            again = None

        @dataclass
        class Child(Base):
            second: int

            @classmethod
            def make(cls, y): ...

            @overload
            def over(self, a: int): ...
            def over(self, a, b): ...
        """,
}


def _rows(*rows: Hook) -> tuple[Hook, ...]:
    return rows


def test_the_source_check_reads_a_tree_without_importing_it(tmp_path):
    root = _tree(tmp_path, FAKE)
    rows = _rows(
        Hook("vllm.core:exported", ("a", "b", "rest", "key", "kw"), "-", "-", "-"),  # re-exported
        Hook("vllm.sched:Child.inherited", ("self", "x"), "-", "-", "-"),  # through the base class
        Hook("vllm.sched:Child.make", ("cls", "y"), "-", "-", "-"),
        Hook("vllm.sched:Child.over", ("self", "a", "b"), "-", "-", "-"),  # the overload is not the def
        Hook("vllm.sched:Child.pool", None, "-", "-", "-"),  # set in the (inherited) __init__
        Hook("vllm.sched:Child", ("first", "second"), "-", "-", "-"),  # dataclass fields, the base's first
        Hook("vllm.sched:again", (), "-", "-", "-", versions="<0.34"),  # not this version's
        Hook("vllm.core:Renamed.inherited", ("self", "x", "y"), "-", "-", "-"),
        Hook("vllm.sched:Child.gone", None, "-", "-", "-"),
        Hook("vllm.nowhere:f", (), "-", "-", "-"),
        Hook("vllm.sched:Child", ("third",), "-", "-", "-"),
    )
    version, results, other = vllm_hooks.check_source(root / "vllm", hooks=rows)
    assert version == "0.34.0" and other == 1
    got = [(status, h.symbol) for status, h, _ in results]
    assert got == [("found", "vllm.core:exported"), ("found", "vllm.sched:Child.inherited"),
                   ("found", "vllm.sched:Child.make"), ("found", "vllm.sched:Child.over"),
                   ("found", "vllm.sched:Child.pool"), ("found", "vllm.sched:Child"),
                   ("changed", "vllm.core:Renamed.inherited"), ("missing", "vllm.sched:Child.gone"),
                   ("missing", "vllm.nowhere:f"), ("changed", "vllm.sched:Child")]
    details = {h.symbol + str(h.params): d for _, h, d in results}
    assert "('self', 'x'), the plugin was written for ('self', 'x', 'y')" in details[
        "vllm.core:Renamed.inherited('self', 'x', 'y')"]
    assert "fields ('third',) gone" in details["vllm.sched:Child('third',)"]
    assert vllm_hooks.check_source(root, version="0.33.0", hooks=rows)[2] == 0  # the row for <0.34 applies
    tree = vllm_hooks.SourceTree.find(root)
    assert tree.shape("vllm.sched:Child") == ("class", ("first", "second"))  # a ClassVar is no field
    assert tree.shape("vllm.sched:again") == ("value", None)  # bound in a try, an import or an assignment


def test_the_command_prints_each_hook_and_exits_0_only_when_all_hold(tmp_path, monkeypatch, capsys):
    root = _tree(tmp_path, FAKE)
    monkeypatch.setattr(vllm_hooks, "HOOKS", _rows(Hook("vllm.core:exported", ("a", "b", "rest", "key", "kw"),
                                                        "-", "-", "-")))
    assert vllm_hooks.main(["--check-source", str(root)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "found    vllm.core:exported" and "1 hooks: 1 found, 0 changed, 0 missing" in out[-1]
    assert out[-1].startswith("vLLM 0.34.0")
    monkeypatch.setattr(vllm_hooks, "HOOKS", _rows(Hook("vllm.core:exported", ("a",), "-", "-", "-"),
                                                   Hook("vllm.core:gone", (), "-", "-", "-")))
    assert vllm_hooks.main(["--check-source", str(root / "vllm")]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("changed  vllm.core:exported: parameters ('a', 'b', 'rest', 'key', 'kw')")
    assert out[1].startswith("missing  vllm.core:gone") and "0 found, 1 changed, 1 missing" in out[-1]
    (root / "vllm" / "_version.py").unlink()
    assert vllm_hooks.main(["--check-source", str(root)]) == 2
    err = capsys.readouterr().err
    assert "--check-source" in err and "give --version" in err
    assert vllm_hooks.main(["--check-source", str(root), "--version", "0.33.0"]) == 1
    assert vllm_hooks.main(["--check-source", str(tmp_path / "nothing")]) == 2
    assert "no vLLM package" in capsys.readouterr().err


def test_the_source_check_agrees_with_the_run_time_check_on_the_installed_vllm():
    import vllm

    version, results, _ = vllm_hooks.check_source(Path(vllm.__file__).parent)
    assert version == vllm.__version__
    assert [(s, h.symbol) for s, h, d in results if s != "found"] == []
    assert len(results) == len(vllm_hooks.rows_for(version))


# ------------------------------------------------------------------------------------ the table true
def test_every_where_names_a_module_of_the_package():
    for h in HOOKS:
        for path in h.where.split(", "):
            assert (PKG / path).is_file(), f"{h.symbol}: where {path!r} is not a module of vllm_contour"


def test_only_the_boundary_package_imports_vllm():
    """``integration/`` is the one package that imports vLLM; elsewhere (ops/, policies/, ...) vLLM's ops are
    taken through the hooks table (``vllm_hooks.resolve``: the row for the installed vLLM)."""
    found = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel.startswith("integration/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            found += [f"{rel}:{node.lineno} {n}" for n in names if n == "vllm" or n.startswith("vllm.")]
    assert found == [], found


def test_each_patch_and_wrap_is_installed_by_the_module_its_row_names():
    """A row patched or wrapped names the module whose source installs it (its symbol or first row's)."""
    for h in HOOKS:
        if h.how.startswith(("patched", "wrapped")):
            sources = " ".join((PKG / p).read_text() for p in h.where.split(", "))
            assert h.key in sources or h.symbol in sources, f"{h.symbol}: not installed in {h.where}"


_VLLM_HANDLES = r"(SamplingParams|EngineArgs|Scheduler|BlockPool|KVCacheManager|pool|manager)"


def patches_outside_the_table(source: str) -> list[str]:
    """Assignments in ``source`` that patch an imported module or class (``importlib.metadata.version = f``,
    ``SamplingParams.x = f``, ``setattr(EngineArgs, ...)``) or a vLLM object by its usual handle
    (``pool.x = f``)."""
    tree = ast.parse(source)
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {(a.asname or a.name).split(".")[0] for a in node.names
                         if not a.name.startswith("vllm_contour")}
        elif isinstance(node, ast.ImportFrom) and not (node.module or "").startswith("vllm_contour") and not node.level:
            imported |= {a.asname or a.name for a in node.names}

    def root(expr):
        while isinstance(expr, ast.Attribute):
            expr = expr.value
        return expr.id if isinstance(expr, ast.Name) else None

    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                and node.args and root(node.args[0]) in imported:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        for t in targets:
            if isinstance(t, ast.Attribute) and root(t) in imported:
                found.append(f"{node.lineno}: {ast.unparse(t)} = ...")
    for n, line in enumerate(source.splitlines(), 1):
        if re.search(rf"^\s*{_VLLM_HANDLES}\.[A-Za-z_]+\s*=[^=]", line):
            found.append(f"{n}: {line.strip()}")
    return found


def test_the_patch_detector_catches_every_kind_of_patch():
    bad = ["import importlib.metadata\nimportlib.metadata.version = lambda n: 'x'\n",
           "def f():\n    import importlib.metadata as md\n    md.version = None\n",
           "from vllm.sampling_params import SamplingParams\nSamplingParams._verify_extra_args = None\n",
           "from vllm.engine import arg_utils\nsetattr(arg_utils.EngineArgs, 'add_cli_args', None)\n",
           "import vllm\nvllm.envs.X += 1\n",
           "def f(pool):\n    pool.get_new_blocks = None\n"]
    for src in bad:
        assert patches_outside_the_table(src), src
    fine = ["import os\nos.environ['VLLM_X'] = '0'\n", "class A:\n    def f(self):\n        self.x = 1\n",
            "from vllm_contour.integration import engine_args\nengine_args.SERVER.config = None\n",
            "def f(mgr):\n    mgr.num_cached_block['r'] = 1\n"]
    for src in fine:
        assert patches_outside_the_table(src) == [], src


# Not hooks into vLLM, each said why: the command hands its arguments to vLLM's main, which reads sys.argv;
# the model fetcher (a tool, never loaded by the plugin) silences transformers' GGUF progress bar and restores it.
NOT_HOOKS = {("integration/frontend/cli.py", "sys.argv"), ("models.py", "gguf_utils.tqdm")}


def test_no_patch_outside_the_table():
    """Assignments to vLLM (or Python) modules and classes happen only through vllm_hooks.patch_class /
    wrap_instance."""
    offenders = []
    for path in PKG.rglob("*.py"):
        if path.name == "vllm_hooks.py":
            continue
        rel = str(path.relative_to(PKG))
        offenders += [f"{rel}:{o}" for o in patches_outside_the_table(path.read_text())
                      if not any(rel == f and f" {target} = " in o for f, target in NOT_HOOKS)]
    assert offenders == []
    declared = {h.symbol.split(":")[1] for h in HOOKS}
    assert {"SamplingParams._verify_extra_args", "EngineArgs.create_engine_config", "BlockPool.get_new_blocks",
            "KVCacheManager.allocate_slots", "version", "_get_attn_isa", "cpu_attn_reshape_and_cache",
            "get_kv_transfer_group", "has_kv_transfer_group", "CPUAttentionMetadata",
            "TritonAttentionMetadata"} <= declared


def test_kvzips_hooks_are_checked_only_where_a_reconstruction_runs(monkeypatch):
    """A vLLM whose ``Request.__init__`` changed refuses nothing for a ``snapkv`` server (start-up checks the
    rows of no feature); a server whose policy reconstructs contexts is refused naming the hook, and a
    request asking for ``kvzip`` later finds the same reason (``feature_refusal``)."""
    from vllm.v1.request import Request

    def changed(self, request_id, prompt_token_ids, sampling_params, *, new_argument=None):
        pass

    monkeypatch.setattr(Request, "__init__", changed)
    assert vllm_hooks.refusal() is None
    msg = vllm_hooks.refusal(frozenset({"reconstruction"}))
    assert msg is not None and "vllm.v1.request:Request.__init__" in msg
    why = vllm_hooks.feature_refusal("reconstruction")
    assert why is not None and "Request.__init__" in why and vllm_hooks.installed_version() in why
    assert all(h.feature in ("", "reconstruction") for h in HOOKS)
    assert {h.symbol.split(":")[1] for h in HOOKS if h.feature == "reconstruction"} == \
        {"Request.__init__", "Request._block_hasher", "Scheduler.add_request"}
