"""A goal row of the benchmark report: what the issue asks for, the measured value, and whether met."""

from __future__ import annotations


def goal(name: str, value: float | None, target: str, met: bool | None) -> dict:
    """One row of the report's goals table (``met`` None: not measured in this run)."""
    return {"goal": name, "value": value, "target": target, "met": met}
