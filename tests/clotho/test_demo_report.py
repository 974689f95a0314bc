"""The demo's verdict and curve image, from a curve given by hand."""

from __future__ import annotations

from PIL import Image

from clotho.demo import draw_curve, learning_verdict

CURVE = [
    {"phase": "sft", "step": 0, "reward": 0.0, "minutes": 0.5},
    {"phase": "sft", "step": 30, "reward": 0.2, "minutes": 1.5},
    {"phase": "sft", "step": 60, "reward": 0.18, "minutes": 2.0},
    {"phase": "rl", "step": 90, "reward": 0.3, "minutes": 4.0},
    {"phase": "rl", "step": 120, "reward": 0.45, "minutes": 6.0},
]


def test_the_verdict_reads_start_plateau_end_and_the_gain_of_rl():
    verdict = learning_verdict(CURVE)
    assert (verdict["start"], verdict["sft_plateau"], verdict["end"]) == (0.0, 0.2, 0.45)
    assert abs(verdict["rl_gain"] - 0.25) < 1e-9
    assert "RL added +0.25" in verdict["line"] and "6.0 minutes" in verdict["line"]
    assert not verdict["criterion_met"] and "not met" in verdict["line"]  # 0.45 < 0.5 above the start
    learned = learning_verdict(CURVE + [{"phase": "rl", "step": 150, "reward": 0.82, "minutes": 8.0}])
    assert learned["criterion_met"] and abs(learned["rl_gain"] - 0.62) < 1e-9
    late = learning_verdict(CURVE + [{"phase": "rl", "step": 150, "reward": 0.82, "minutes": 16.0}])
    assert not late["criterion_met"]
    assert learning_verdict([]) == {"line": "no evaluation ran"}


def test_the_curve_is_drawn_in_each_phase_color(tmp_path):
    path = tmp_path / "curve.png"
    draw_curve(CURVE, path)
    image = Image.open(path).convert("RGB")
    colors = set(image.getdata())
    assert image.size == (720, 400)
    assert (52, 101, 164) in colors and (204, 0, 0) in colors
