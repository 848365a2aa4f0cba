"""Benchmarks (run from the repository root: ``python -m benchmarks.<name>``)."""
import sys
import time


def stamp(res: dict, argv: list[str] | None = None) -> dict:
    """Record how a result was produced (``argv`` after ``python -m benchmarks.<name>``, and the date) so
    ``python -m benchmarks.report`` can quote the command next to its table. Existing keys win."""
    res.setdefault("argv", list(sys.argv[1:] if argv is None else argv))
    res.setdefault("date", time.strftime("%Y-%m-%d"))
    return res
