"""Summary lines at the end of every test run (just before ``-rs``'s short summary, which ``scripts/test.sh``
keeps):

* the C++ kernels, where the run loaded them: the ISA level and decode path the tests ran at by default, the
  levels this CPU runs and those compiled in, and the levels ``tests/unit/test_cpu_paths.py`` ran at;
* every skipped test, one line each with its reason (pytest's ``-rs`` folds skips of one place into one line).
"""

from __future__ import annotations

import sys


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def _cpp_kernels(terminalreporter) -> list[str]:
    cpu_ext = sys.modules.get("vllm_contour.ops.cpu_ext")
    if cpu_ext is None:  # no test touched the C++ kernels
        return []
    if cpu_ext._mod is None:
        return [f"not loaded: {cpu_ext.LOAD_ERROR or 'no test loaded them'}"]
    try:
        lines = [f"main run at {cpu_ext.describe()}"]
    except RuntimeError as e:  # a module built from older sources
        return [str(e)]
    ran = {value for reports in terminalreporter.stats.values() for r in reports
           if getattr(r, "when", None) == "call" and r.outcome == "passed"
           for key, value in getattr(r, "user_properties", ()) if key == "cpu_isa"}
    if ran:
        lines.append("levels forced and passed (test_cpu_paths.py): "
                     + ", ".join(lv for lv in cpu_ext.LEVELS if lv in ran))
    return lines


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    lines = _cpp_kernels(terminalreporter)
    if lines:
        terminalreporter.write_sep("-", "vllm-contour C++ kernels")
        for line in lines:
            terminalreporter.write_line(line)
    skipped = terminalreporter.stats.get("skipped", [])
    terminalreporter.write_sep("-", f"skipped: {len(skipped)}")
    for report in skipped:
        terminalreporter.write_line(f"SKIPPED {report.nodeid}: {_skip_reason(report)}")
