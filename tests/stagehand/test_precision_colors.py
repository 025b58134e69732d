"""Every precision has a colour of its own in every plot, from the one table built from the registry."""

from __future__ import annotations

import pytest

from torch_stagehand.app import colors as palette
from torch_stagehand.app.colors import precision_colors
from torch_stagehand.runtime import precision as precisions
from torch_stagehand.runtime.precision import Precision


class Dummy(Precision):
    """Only a name and a code: the colour table reads nothing else."""

    derived_from_master = True

    def __init__(self, name: str, code: int):
        self.name, self.code = name, code

    layer_nbytes = layer_layout = views = write = linear_from_slot = grad_input_from_slot = None


def _distinct(colors: dict[str, str]) -> bool:
    return len(set(colors.values())) == len(colors)


def test_every_registered_precision_has_its_own_color():
    colors = precision_colors()
    assert list(colors) == list(precisions.names()) and len(colors) >= 9
    assert _distinct(colors)
    assert colors["bf16"] != colors["fp8-attn"] and colors["int8"] != colors["fp8-mlp"]  # shared before


def test_the_named_and_spare_colors_never_collide():
    assert len(set(palette._NAMED.values()) | set(palette._SPARE)) == len(palette._NAMED) + len(palette._SPARE)


def test_a_newly_registered_precision_gets_a_new_color():
    before = precision_colors()
    extra = [precisions.register(Dummy(f"dummy{i}", 100 + i)) for i in range(12)]  # past the spare colours
    try:
        colors = precision_colors()
        assert _distinct(colors) and all(e.name in colors for e in extra)
        assert {n: colors[n] for n in before} == before  # the built-in precisions keep their colours
    finally:
        for e in extra:
            precisions.unregister(e.name)


def test_a_precision_only_the_telemetry_names_gets_a_color_too():
    colors = precision_colors(["int4", "bf16"])
    assert list(colors)[-1] == "int4" and _distinct(colors)


@pytest.mark.parametrize("figure", ["demo", "telemetry"])
def test_both_precision_maps_draw_from_the_table(figure, tmp_path, monkeypatch):
    """The demo's and `stagehand plot`'s heatmaps: each legend entry and each colour of the map is the
    table's, the map's cells show each block's precision, and a name the registry lacks does not fail."""
    pytest.importorskip("matplotlib")
    from torch_stagehand.app import plots, telemetry_plots

    drawn = {}
    original = plots.draw_precision_map

    def spy(ax, records, blocks, labels, extent):
        drawn["colors"] = original(ax, records, blocks, labels, extent)
        drawn["ax"] = ax
        return drawn["colors"]

    monkeypatch.setattr(plots, "draw_precision_map", spy)
    monkeypatch.setattr(telemetry_plots, "draw_precision_map", spy)
    records = [{"step_id": s, "precision": {"0": "fp8-attn", "1": "int8-mlp", "2": "int4"}} for s in range(3)]
    if figure == "demo":
        plots.demo_figure([1.0, 0.9, 0.8], records, ["b0", "b1", "b2"], str(tmp_path / "demo.png"))
    else:
        telemetry_plots.precision_figure(records, str(tmp_path / "precision.png"), "t")
    colors, ax = drawn["colors"], drawn["ax"]
    assert colors == precision_colors(["int4"])
    legend = {t.get_text(): h.get_facecolor() for t, h in zip(ax.get_legend().get_texts(),
                                                              ax.get_legend().legend_handles)}
    from matplotlib.colors import to_hex, to_rgba

    assert {n: to_hex(c) for n, c in legend.items()} == colors
    image = ax.get_images()[0]
    cells = image.get_array()  # the indices of each block's precision, per step
    shown = [to_hex(image.cmap(image.norm(v))) for v in cells[:, 0]]
    assert shown == [colors["fp8-attn"], colors["int8-mlp"], colors["int4"]]
    assert to_rgba(shown[0]) != to_rgba(colors["bf16"])
