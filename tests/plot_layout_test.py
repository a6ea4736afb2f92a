"""Tests for rope_jax.experiments.plot_layout: markers are layouts.positions, CLI, errors."""

import os

import matplotlib.image
import numpy as np
import pytest

from rope_jax import layouts, rotary
from rope_jax.experiments import plot_layout

IMAGE = "text:4,image:3x5,text:3"
VIDEO = "text:2,video:2x3x3,text:2"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _drawn(ax, kinds_of_label):
    """label -> marker offsets [P, 2] (x = w id, y = h id) of every scatter in `ax`."""
    return {c.get_label(): np.asarray(c.get_offsets()) for c in ax.collections
            if c.get_label() in kinds_of_label}  # fmt: skip


def test_cli_writes_png(tmp_path, capsys):
    out = tmp_path / "sub" / "fig.png"
    argv = ["--scheme=rope_tv", f"--segments={IMAGE}", f"--out={out}"]
    assert plot_layout.main(argv) == str(out)
    assert capsys.readouterr().out.strip() == str(out)
    assert out.read_bytes()[:8] == PNG_MAGIC
    pixels = matplotlib.image.imread(out)
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100
    assert pixels.std() > 0  # not a blank canvas


@pytest.mark.slow
def test_cli_default_out_and_all_with_video(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plot_layout.main(["--scheme=rope_tv", f"--segments={IMAGE}"])
    assert (tmp_path / "layout_rope_tv.png").read_bytes()[:8] == PNG_MAGIC
    plot_layout.main(["--scheme=all", f"--segments={VIDEO}"])  # rope_tie rows do not raise
    assert (tmp_path / "layout_all.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize(
    "scheme, spec, num_axes",
    [
        ("rope_tv", IMAGE, 2),
        ("mrope", IMAGE, 2),
        ("rope_tie", IMAGE, 2),
        ("rope_tie_frac", "text:1,image:2x3,text:2,image:1x4", 2),
        ("rope_tv", "image:2x3,text:2", 2),  # half-integer ids
        ("rope_tv", VIDEO, 3),
        ("mrope", VIDEO, 3),
        ("flat", VIDEO, 3),
    ],
)
def test_markers_are_layout_positions(scheme, spec, num_axes):
    segments = layouts.parse_segments(spec)
    pos = layouts.positions(segments, scheme, num_axes)
    kinds = layouts.modality(segments)
    fig, panels = plot_layout.figure(segments, [scheme], num_axes)
    ax = panels[scheme]["scatter"]
    drawn = _drawn(ax, set(plot_layout.KINDS.values()))
    expected = {name: pos[kinds == k][:, [-1, -2]] for k, name in plot_layout.KINDS.items()}
    expected = {name: xy for name, xy in expected.items() if len(xy)}
    assert drawn.keys() == expected.keys()
    for name, xy in expected.items():
        np.testing.assert_allclose(drawn[name], xy, err_msg=name)
    path = ax.lines[0].get_xydata()  # reading-order line visits every token in order
    np.testing.assert_allclose(path, pos[:, [-1, -2]])
    assert ax.yaxis_inverted()  # h grows downward
    lines = panels[scheme]["axes"].lines
    assert len(lines) == num_axes
    for a, line in enumerate(lines):
        np.testing.assert_allclose(line.get_ydata(), pos[:, a])
        np.testing.assert_array_equal(line.get_xdata(), np.arange(len(pos)))


def test_new_variants_markers_are_layout_positions():
    """videorope (2 and 3 axes, any delta) and time-aligned mrope draw their positions."""
    timed = "text:2,video:3x2x2@1,text:2"
    cases = [("videorope", IMAGE, 2, {}), ("videorope", VIDEO, 3, {"delta": 3.0}),
             ("mrope", timed, 3, {"tokens_per_second": 2.0, "delta": 3.0})]  # fmt: skip
    for scheme, spec, num_axes, settings in cases:
        segments = layouts.parse_segments(spec)
        own = {k: v for k, v in settings.items() if scheme in layouts.SETTINGS[k]}
        pos = layouts.positions(segments, scheme, num_axes, **own)
        _, panels = plot_layout.figure(segments, [scheme], num_axes, settings=settings)
        ax = panels[scheme]["scatter"]
        np.testing.assert_allclose(ax.lines[0].get_xydata(), pos[:, [-1, -2]])
        for a, line in enumerate(panels[scheme]["axes"].lines):
            np.testing.assert_allclose(line.get_ydata(), pos[:, a])
        assert all(f"{k}={v:g}" in ax.get_title() for k, v in own.items())
    mrope = layouts.positions(layouts.parse_segments(timed), "mrope", 3, tokens_per_second=2)
    np.testing.assert_array_equal(np.unique(mrope[2:14, 0]), [2, 4, 6])  # time-aligned


def test_allocation_strip_is_the_pair_table():
    segments = layouts.parse_segments(VIDEO)
    names = list(rotary.ALLOCATIONS)
    fig, panels = plot_layout.figure(segments, ["mrope"], 3, allocations=names, head_dim=32)
    strip = panels["allocation"]["strip"]
    want = np.stack([
        rotary.axis_of_pair(32, num_axes=3, allocation=name,
                            sections=rotary.reference_sections(name, 32, 3))
        for name in names
    ])  # fmt: skip
    np.testing.assert_array_equal(strip.images[0].get_array(), want)
    assert [t.get_text() for t in strip.get_yticklabels()] == names
    _, panels = plot_layout.figure(segments, ["mrope"], 3, allocations=["sections"],
                                   head_dim=16, sections=(2, 3, 3))  # fmt: skip
    np.testing.assert_array_equal(
        panels["allocation"]["strip"].images[0].get_array(), [[0, 0, 1, 1, 1, 2, 2, 2]]
    )
    fig.canvas.draw()


def test_cli_settings_and_allocations_are_checked():
    args = plot_layout.parse_args(["--scheme=all", f"--segments={VIDEO}", "--delta=1.5",
                                   "--allocation=videorope,sections,videorope",
                                   "--sections=4,6,6", "--head_dim=32"])  # fmt: skip
    segments, schemes, num_axes = plot_layout.check_args(args)
    extras = plot_layout.check_extras(args, schemes, num_axes)
    assert extras == dict(settings={"delta": 1.5}, allocations=["videorope", "sections"],
                          head_dim=32, sections=(4, 6, 6))  # fmt: skip
    assert plot_layout.scheme_settings("videorope", extras["settings"]) == {"delta": 1.5}
    assert plot_layout.scheme_settings("mrope", extras["settings"]) == {}
    for flags, match in (
        (["--tokens_per_second=2", "--scheme=rope_tv"], "read by scheme mrope"),
        (["--allocation=nope"], "unknown allocation 'nope'"),
        (["--allocation=sections", "--sections=1,1"], "has 2 entries"),
    ):
        args = plot_layout.parse_args([f"--segments={VIDEO}", "--scheme=mrope", *flags])
        with pytest.raises(ValueError, match=match):
            plot_layout.check_extras(args, *plot_layout.check_args(args)[1:])  # fmt: skip


@pytest.mark.slow
def test_cli_draws_the_new_variants(tmp_path):
    out = tmp_path / "v.png"
    argv = ["--scheme=mrope,videorope", "--segments=text:2,video:3x2x2@1,text:2",
            "--tokens_per_second=2", "--delta=1.5", "--allocation=all", "--head_dim=32",
            f"--out={out}"]  # fmt: skip
    assert plot_layout.main(argv) == str(out)
    assert out.read_bytes()[:8] == PNG_MAGIC
    args = plot_layout.parse_args(argv)
    assert plot_layout.command_line(args) == (
        "python -m rope_jax.experiments.plot_layout --scheme=mrope,videorope "
        '--segments="text:2,video:3x2x2@1,text:2" --tokens_per_second=2 --delta=1.5 '
        f"--allocation=all --head_dim=32 --out={out}"
    )


def test_video_markers_coloured_by_t():
    segments = layouts.parse_segments(VIDEO)
    pos = layouts.positions(segments, "rope_tv", 3)
    _, panels = plot_layout.figure(segments, ["rope_tv"], 3)
    (video,) = [c for c in panels["rope_tv"]["scatter"].collections if c.get_label() == "video"]
    np.testing.assert_allclose(video.get_array(), pos[layouts.modality(segments) > 0, 0])


def test_all_one_row_per_scheme_and_error_panel():
    segments = layouts.parse_segments(VIDEO)
    fig, panels = plot_layout.figure(segments, list(layouts.SCHEMES), 3)
    assert list(panels) == list(layouts.SCHEMES)
    for scheme in ("rope_tie", "rope_tie_frac"):
        assert set(panels[scheme]) == {"error"}
        text = " ".join(t.get_text() for t in panels[scheme]["error"].texts)
        assert scheme in text and "video" in text
    for scheme in ("flat", "mrope", "rope_tv"):
        assert set(panels[scheme]) == {"scatter", "axes"}
    fig.canvas.draw()  # the whole figure renders


def test_one_axis_draws_only_per_axis_panel():
    segments = layouts.parse_segments(IMAGE)
    _, panels = plot_layout.figure(segments, ["flat"], 1)
    assert set(panels["flat"]) == {"axes"}
    np.testing.assert_allclose(
        panels["flat"]["axes"].lines[0].get_ydata(), np.arange(layouts.num_tokens(segments))
    )


@pytest.mark.parametrize(
    "argv, names",
    [
        (["--scheme=rope_tv", "--segments=text:4,pic:3x3"], "pic:3x3"),
        (["--scheme=rope_tv", "--segments=text:4,image:3"], "image:3"),
        (["--scheme=rope_tv", "--segments="], "--segments is empty"),
        (["--scheme=rope_xx", f"--segments={IMAGE}"], "rope_xx"),
        (["--scheme=mrope,", f"--segments={IMAGE}"], "unknown scheme ''"),
        (["--scheme=rope_tv", f"--segments={IMAGE}", "--num_axes=4"], "--num_axes"),
        (["--scheme=rope_tv", f"--segments={IMAGE}", "--num_axes=two"], "--num_axes"),
        (["--scheme=rope_tie", f"--segments={VIDEO}"], "'rope_tie' is defined for images"),
        (["--scheme=rope_tie", f"--segments={IMAGE}", "--num_axes=3"], "num_axes=3"),
        (["--scheme=rope_tv", f"--segments={VIDEO}", "--num_axes=2"], "video"),
        (["--scheme=mrope", f"--segments={VIDEO}", "--delta=2"], "--delta is read by scheme"),
        (["--scheme=videorope", f"--segments={VIDEO}", "--delta=-1"], "--delta must be"),
        (["--scheme=mrope", f"--segments={VIDEO}", "--tokens_per_second=x"], "--tokens_per"),
        (["--scheme=mrope", f"--segments={VIDEO}", "--allocation=mrope3"], "'mrope3'"),
        (["--scheme=mrope", f"--segments={VIDEO}", "--allocation=all", "--head_dim=7"],
         "--head_dim"),
        (["--scheme=mrope", f"--segments={VIDEO}", "--allocation=videorope",
          "--sections=4,7,5", "--head_dim=32"], "do not fit allocation='videorope'"),
        (["--scheme=mrope", f"--segments={VIDEO}", "--allocation=sections", "--sections=a"],
         "--sections"),
        (["--scheme=videorope", "--segments=text:1,video:2x2x2@0,text:1"], "video:2x2x2@0"),
        (["--scheme=mrope", f"--segments={VIDEO}", "--sections=4,6,6"],
         "--sections sets the allocation strip, which only --allocation draws"),
        (["--scheme=mrope", f"--segments={VIDEO}", "--head_dim=32"], "--head_dim sets"),
        (["--scheme=mrope", f"--segments={VIDEO}", "--out={tmp}/x.foo"],
         "--out={tmp}/x.foo: matplotlib writes no 'foo' files; use a suffix of"),
        (["--scheme=mrope", f"--segments={VIDEO}", "--out={tmp}/x.png/y.png"],
         "--out={tmp}/x.png/y.png"),  # below a file (the default --out below)
    ],
)  # fmt: skip
def test_errors_are_one_line(tmp_path, argv, names):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    names = names.replace("{tmp}", str(tmp_path))
    (tmp_path / "x.png").write_bytes(b"")  # an earlier figure, or the file --out is below
    if not any(a.startswith("--out=") for a in argv):
        argv.append(f"--out={tmp_path / 'x.png'}")
    with pytest.raises(SystemExit) as e:
        plot_layout.main(argv)
    message = str(e.value.code)
    assert message.startswith("error: ") and "\n" not in message
    assert names in message
    assert os.listdir(tmp_path) == ["x.png"] and not (tmp_path / "x.png").read_bytes()


def test_the_suffix_of_out_picks_the_format(tmp_path):
    out = tmp_path / "fig.svg"
    plot_layout.main(["--scheme=rope_tv", f"--segments={IMAGE}", f"--out={out}"])
    assert out.read_text().lstrip().startswith("<?xml") and "<svg" in out.read_text()


def test_command_in_suptitle():
    args = plot_layout.parse_args(
        ["--scheme=all", f"--segments={IMAGE}", "--out=results/research/layouts.png"]
    )
    assert plot_layout.command_line(args) == (
        "python -m rope_jax.experiments.plot_layout --scheme=all "
        '--segments="text:4,image:3x5,text:3" '
        "--out=results/research/layouts.png"
    )


def test_a_sequence_too_long_to_draw_is_refused_at_once(tmp_path):
    """~100k tokens: one line before any drawing (the old path ran for minutes)."""
    segments = "text:50000,image:200x200,text:10000"
    with pytest.raises(SystemExit, match="plot_layout draws at most 2,000"):
        plot_layout.main(["--scheme=all", f"--segments={segments}", f"--out={tmp_path}/x.png"])
    assert not (tmp_path / "x.png").exists()
