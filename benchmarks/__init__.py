"""Benchmarks (run from the repository root: ``python -m benchmarks.<name>``)."""
import sys
import time


def stamp(res: dict, argv: list[str] | None = None) -> dict:
    """Record how a result was produced (``argv`` after ``python -m benchmarks.<name>``, and the date) so
    ``python -m benchmarks.report`` can quote the command next to its table. Existing keys win."""
    res.setdefault("argv", list(sys.argv[1:] if argv is None else argv))
    res.setdefault("date", time.strftime("%Y-%m-%d"))
    return res


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
