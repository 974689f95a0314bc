"""The demo's verdict and curve image, from a curve given by hand."""

from __future__ import annotations

from PIL import Image

from clotho.demo import TRAINING_COLOR, draw_curve, learning_verdict

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


def test_without_sft_the_verdict_asks_the_real_demos_gain_over_the_models_own_start():
    curve = [
        {"phase": "rl", "step": s, "reward": r, "minutes": m}
        for s, r, m in ((0, 0.28, 0.5), (5, 0.5, 3.0), (10, 0.6, 5.5))
    ]
    verdict = learning_verdict(curve)
    assert verdict["sft_plateau"] == verdict["start"] == 0.28 and verdict["criterion_met"]
    assert "0.28 at the start (the model's own), 0.60 at the end (+0.32) in 5.5 minutes" in verdict["line"]
    assert "+0.30 first after 5.5 minutes: learned (+0.30 within 15 minutes)" in verdict["line"]
    assert not learning_verdict(curve[:2])["criterion_met"]  # +0.22
    assert not learning_verdict([*curve[:2], {**curve[2], "minutes": 15.5}])["criterion_met"]  # too late
    longer = [*curve, {"phase": "rl", "step": 40, "reward": 0.7, "minutes": 20.0}]
    assert learning_verdict(longer)["criterion_met"]  # reached at 5.5 minutes, held to the end
    fell = [*curve, {"phase": "rl", "step": 40, "reward": 0.5, "minutes": 20.0}]
    assert not learning_verdict(fell)["criterion_met"]


def test_with_the_stop_rules_window_the_verdict_reads_running_means_not_single_evaluations():
    curve = CURVE + [{"phase": "rl", "step": s, "reward": r, "minutes": 7.0} for s, r in ((150, 0.9), (180, 0.6))]
    verdict = learning_verdict(curve, window=3)
    assert abs(verdict["sft_plateau"] - 0.38 / 3) < 1e-9  # the SFT phase's best mean of 3: (0 + 0.2 + 0.18) / 3
    assert abs(verdict["end"] - 0.65) < 1e-9  # the last 3 RL evaluations (0.45, 0.9, 0.6), not the last one
    assert "(means of 3 evaluations)" in verdict["line"] and verdict["criterion_met"]
    assert learning_verdict(curve[:4], window=3)["end"] == 0.3  # fewer evaluations than the window: their mean


def near(color: tuple[int, int, int], pixels, tolerance: int = 12) -> bool:
    """Whether any of `pixels` is `color` give or take antialiasing's blending."""
    return any(all(abs(a - b) <= tolerance for a, b in zip(color, pixel)) for pixel in pixels)


def test_the_curve_is_drawn_in_each_phase_color_with_the_training_reward(tmp_path):
    path = tmp_path / "curve.png"
    curve = [{**row, "train_reward": 0.5 if row["phase"] == "rl" else None} for row in CURVE]
    draw_curve(curve, path)
    image = Image.open(path).convert("RGB")
    colors = set(image.getdata())
    assert image.size == (760, 460)
    assert near((52, 101, 164), colors) and near((204, 0, 0), colors) and near(TRAINING_COLOR, colors)
    # The training line runs between the two RL evaluations at reward 0.5: the plot's middle row.
    middle = (56 + (460 - 78)) // 2
    assert near(
        TRAINING_COLOR, [image.getpixel((x, y)) for x in range(500, 680) for y in (middle - 1, middle, middle + 1)]
    )


def test_the_legend_sits_above_the_plot_not_on_the_curve(tmp_path):
    path = tmp_path / "curve.png"
    high = [
        {"phase": "rl", "step": step, "reward": 0.9, "minutes": step / 10, "train_reward": 0.95}
        for step in (0, 150, 155, 157, 160)
    ]
    draw_curve(high, path)
    image = Image.open(path).convert("RGB")
    legend_band = [image.getpixel((x, y)) for x in range(image.size[0]) for y in range(18, 52)]
    assert near((204, 0, 0), legend_band) and near(TRAINING_COLOR, legend_band)
    # The plot's top right, where a legend inside the axes would sit over the end of a rising curve:
    # only the white background and grey grid lines between the frame and the curves (0.95 at y 72).
    corner = {image.getpixel((x, y)) for x in range(560, 730) for y in range(58, 66)}
    assert all(r == g == b and r >= 200 for r, g, b in corner), corner
