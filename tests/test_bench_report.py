"""The README's benchmark table and demo figures are what bench/report.py renders from
bench/results/*.json: numbers are never typed into the README by hand."""

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def bench_report():
    spec = importlib.util.spec_from_file_location("bench_report", REPO / "bench" / "report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    return report


@pytest.mark.parametrize("block, source", [("readme_block", "bench/results/*.json"), ("demo_block", "bench/results/demo.json")])
def test_readme_numbers_are_rendered_from_the_results(block, source):
    assert getattr(bench_report(), block)() in (REPO / "README.md").read_text(), (
        f"README's {block} differs from {source}: run `python bench/report.py --readme`"
    )
