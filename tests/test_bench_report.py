"""The README's benchmark table is what bench/report.py renders from bench/results/*.json: numbers
are never typed into the README by hand."""

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_readme_table_is_rendered_from_the_results():
    spec = importlib.util.spec_from_file_location("bench_report", REPO / "bench" / "report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    assert report.readme_block() in (REPO / "README.md").read_text(), (
        "README's benchmark table differs from bench/results/*.json: run `python bench/report.py --readme`"
    )


def test_readme_demo_figures_are_rendered_from_the_recorded_demo():
    spec = importlib.util.spec_from_file_location("bench_report", REPO / "bench" / "report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    assert report.demo_block() in (REPO / "README.md").read_text(), (
        "README's demo figures differ from bench/results/demo.json: run `python bench/report.py --readme`"
    )
