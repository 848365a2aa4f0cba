"""Benchmarks (run from the repository root: ``python -m benchmarks.<name>``)."""
import sys
import time


def stamp(res: dict, argv: list[str] | None = None) -> dict:
    """Record how a result was produced (``argv`` after ``python -m benchmarks.<name>``, and the date) so
    ``python -m benchmarks.report`` can quote the command next to its table. Existing keys win. Returns the
    record with this machine's paths made portable (``portable``): results are committed."""
    res.setdefault("argv", list(sys.argv[1:] if argv is None else argv))
    res.setdefault("date", time.strftime("%Y-%m-%d"))
    return portable(res)


def portable(x):
    """``x`` (dicts, lists, strings) with this machine's paths rewritten: a bundled model's cache directory
    becomes its name, the repository root and the environment's ``bin/`` go, the temporary directory becomes
    ``results/``."""
    if isinstance(x, dict):
        return {k: portable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(portable(v) for v in x)
    if not isinstance(x, str):
        return x
    for old, new in _path_rewrites():
        x = x.replace(old, new)
    return x


def _path_rewrites() -> list[tuple[str, str]]:
    import tempfile
    from pathlib import Path

    from vllm_contour.models import home_dir

    root = Path(__file__).resolve().parents[1]
    return [(f"{home_dir() / 'models'}/", ""), (f"{Path(sys.prefix) / 'bin'}/", ""), (f"{root}/", ""),
            (f"{Path(tempfile.gettempdir())}/", "results/")]


def fmt_cell(v, nd: int = 2) -> str:
    """A markdown table cell: '-' for None/NaN, floats to ``nd`` decimals."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return "-" if v != v else f"{v:.{nd}f}"
    return str(v)


def md_table(header: list[str], rows: list[list], nd: int = 2) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt_cell(c, nd) for c in r) + " |" for r in rows]
    return "\n".join(lines)
