"""chipledger/reports/charts.py on its own: figures from plain data (the statements reuse them), empty data drawn as
"no data" rather than failing, HTML escaped."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from chipledger.reports import charts

T = datetime(2026, 11, 2, tzinfo=timezone.utc)


def test_charts_render_to_png_and_inline_svg(tmp_path):
    hours = [T + timedelta(hours=i) for i in range(3)]
    fig = charts.capacity_chart(hours, {"idle": [1.0, 2.0, 3.0], "in_quota": [3.0, 2.0, 1.0], "custom": [0, 0, 1]})
    ax = fig.axes[0]
    # stacking order: the accounts in their fixed order, unknown ones after
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["in_quota", "idle", "custom"]
    path = charts.save_png(fig, tmp_path / "sub" / "c.png")
    assert path.read_bytes().startswith(b"\x89PNG")
    svg = charts.svg_text(charts.latency_chart(["a", "b"], [1, 2], [3, None], [5, 6], threshold_s=600))
    assert svg.startswith("<svg") and "<?xml" not in svg


def test_empty_data_says_so():
    for fig in (charts.capacity_chart([], {}), charts.latency_chart([], [], [], []),
                charts.heatmap_chart([[None] * 24 for _ in range(7)])):
        assert "no data" in [t.get_text() for t in fig.axes[0].texts]


def test_heatmap_shape_and_html_escaping():
    m = [[None] * 24 for _ in range(7)]
    m[0][1] = 4.5
    fig = charts.heatmap_chart(m)
    image = fig.axes[0].images[0].get_array()
    assert image.shape == (7, 24) and image[0, 1] == 4.5 and image.mask[0, 0]
    page = charts.html_page("<T>", [("h & h", charts.html_table(["a<b"], [["x & y"]]))], subtitle="s")
    assert "<title>&lt;T&gt;</title>" in page and "<th>a&lt;b</th>" in page and "<td>x &amp; y</td>" in page


def test_capacity_is_charted_per_pool_never_summed():
    """H100s and TPU cores are different chips: one panel per pool, sharing the time axis."""
    hours = [T + timedelta(hours=i) for i in range(2)]
    fig = charts.capacity_charts(hours, {"z/tpu-v5e": {"idle": [8.0, 8.0]},
                                         "z/h100": {"in_quota": [50.0, 60.0], "idle": [14.0, 4.0]}})
    assert [ax.get_title() for ax in fig.axes] == ["z/h100", "z/tpu-v5e"]  # largest first
    h100, tpu = (ax.get_ylim()[1] for ax in fig.axes)
    assert h100 >= 64 and tpu < 64  # the TPU panel is not drawn on the H100s' scale
    many = charts.capacity_charts(hours, {f"p{i}": {"idle": [float(i), float(i)]} for i in range(10)}, max_panels=3)
    assert [ax.get_title() for ax in many.axes] == ["p9", "p8", "p7"]
    assert "7 more pool(s) not drawn" in many._supxlabel.get_text()
