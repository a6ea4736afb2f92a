"""Draws the position ids of a text / image / video sequence, as the RoPE-Tie articles do.

  python -m rope_jax.experiments.plot_layout --scheme=rope_tv --segments="text:4,image:3x5,text:3"
  python -m rope_jax.experiments.plot_layout --scheme=all --segments="text:4,image:3x5,text:3" \\
      --out=results/research/layouts.png
  python -m rope_jax.experiments.plot_layout --scheme=mrope,rope_tv \\
      --segments="text:2,video:2x3x3,text:2"
  python -m rope_jax.experiments.plot_layout --scheme=mrope,videorope --tokens_per_second=2 \\
      --segments="text:2,video:3x3x3@1,text:2" --allocation=mrope_interleaved,videorope

One row per scheme (`--scheme` takes a name from `layouts.SCHEMES`, a comma-separated list
or `all`). Left: every token / patch at its (h, w) position ids (x = w, y = h increasing
downward), text on the diagonal, token index next to each marker and consecutive tokens
joined by a thin line; equal aspect, a grid line at every integer id, each panel zoomed to its
own range; on 3 axes the colour of a patch is its t-axis id. Right: position id
per axis vs token index. A scheme that cannot place the sequence on `--num_axes` gets a
panel saying why (a single requested scheme exits with `error: ...` instead). Default
`--num_axes`: 3 if the sequence holds a video, else 2. Writes `layout_<scheme>.png` unless
`--out` is given.

Layout settings (`layouts.SETTINGS`) go to the schemes that read them: `--tokens_per_second`
(mrope: Qwen2.5-VL time-aligned temporal ids of videos written `video:TxHxW@SECONDS`) and
`--delta` (videorope's temporal spacing). `--allocation` (names from
`rotary.ALLOCATIONS`, comma-separated, or `all`) adds a last row: which axis drives each
of the `--head_dim`/2 rotation pairs, fastest pair on the left, with `--sections` (default
`rotary.reference_sections`).
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator, MultipleLocator

from rope_jax import layouts, rotary, signals
from rope_jax.experiments import report

KINDS = {layouts.TEXT: "text", layouts.IMAGE: "image", layouts.VIDEO: "video"}
COLORS = {layouts.TEXT: "tab:blue", layouts.IMAGE: "tab:orange", layouts.VIDEO: "tab:green"}
MARKERS = {layouts.TEXT: "o", layouts.IMAGE: "s", layouts.VIDEO: "D"}
AXIS_STYLE = {"t": ("tab:purple", "-", 2.5), "h": ("tab:red", "--", 1.6), "w": ("k", ":", 1.2)}


def axis_names(num_axes: int) -> tuple[str, ...]:
    """Names of the A position axes: `(t, h, w)` for 3, `(h, w)` for 2, `("pos",)` for 1."""
    return ("pos",) if num_axes == 1 else ("t", "h", "w")[3 - num_axes :]


def scheme_settings(scheme: str, settings: dict) -> dict:
    """The layout settings of `settings` that `scheme` reads (`layouts.SETTINGS`)."""
    return {k: v for k, v in settings.items() if v is not None and scheme in layouts.SETTINGS[k]}


def layout_points(
    segments: Sequence[layouts.Segment], scheme: str, num_axes: int, **settings
) -> tuple[np.ndarray, np.ndarray]:
    """(positions [T, A] float32, modality [T] int8); ValueError if `scheme` cannot place it.
    `settings` may hold settings of other schemes: `scheme` gets only its own."""
    pos = layouts.positions(segments, scheme, num_axes, **scheme_settings(scheme, settings))
    return pos, layouts.modality(segments)


def allocation_table(
    allocations: Sequence[str], head_dim: int, num_axes: int, sections=None
) -> np.ndarray:
    """Axis of every rotation pair under each allocation: int32 [len(allocations), H/2].

    `sections` None = `rotary.reference_sections` of each allocation ("alternating" reads
    none).
    """
    rows = []
    for name in allocations:
        own = rotary.reference_sections(name, head_dim, num_axes) if sections is None else sections
        own = None if name == "interleaved" else own
        rows.append(rotary.axis_of_pair(head_dim, num_axes=num_axes, allocation=name, sections=own))
    return np.stack(rows)


def draw_allocation(ax, table: np.ndarray, allocations: Sequence[str], num_axes: int) -> None:
    """One strip per allocation: cell i coloured by the axis driving pair i (table [N, P])."""
    names = axis_names(num_axes)
    colors = [AXIS_STYLE.get(n, ("0.5",))[0] for n in names]
    ax.imshow(table, cmap=ListedColormap(colors), vmin=-0.5, vmax=len(names) - 0.5,
              aspect="auto", interpolation="nearest")  # fmt: skip
    ax.set_yticks(range(len(allocations)), allocations, fontsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("rotation pair i (frequency falls to the right)", fontsize=8)
    ax.tick_params(labelsize=7)
    handles = [Patch(color=c, label=f"{n} axis") for n, c in zip(names, colors, strict=True)]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title("axis driving each rotation pair", fontsize=9)


def _labels(xy: np.ndarray) -> dict[tuple[float, float], str]:
    """Point -> token indices drawn there, one per line (video frames can share an (h, w))."""
    out: dict[tuple[float, float], list[str]] = {}
    for i, (x, y) in enumerate(xy.tolist()):
        out.setdefault((x, y), []).append(str(i))
    return {p: "\n".join(v) for p, v in out.items()}


def draw_scatter(ax, pos: np.ndarray, kinds: np.ndarray, *, title: str):
    """(h, w) scatter of positions [T, A>=2]: x = w id, y = h id (down), equal aspect, a
    unit grid; returns the colorbar mappable on 3 axes (colour = t id of a patch), else None."""
    xy = pos[:, [-1, -2]]  # (w, h)
    ax.plot(xy[:, 0], xy[:, 1], lw=0.6, color="0.6", zorder=1)
    t_ids = pos[kinds != layouts.TEXT, 0] if pos.shape[1] == 3 else np.zeros(0)
    norm = (t_ids.min(), max(t_ids.max(), t_ids.min() + 1)) if t_ids.size else None
    mappable = None
    for kind, name in KINDS.items():
        mask = kinds == kind
        if not mask.any():
            continue
        style = dict(marker=MARKERS[kind], s=24, edgecolors="k", linewidths=0.5, zorder=2)
        if norm and kind != layouts.TEXT:
            t = pos[mask, 0]  # earlier frames larger: overlapping frames show as rings
            size = 14 * (1 + 2.5 * (norm[1] - t) / (norm[1] - norm[0]))
            style.update(c=t, cmap="viridis", vmin=norm[0], vmax=norm[1], s=size)
            mappable = ax.scatter(*xy[mask].T, label=name, **style)
        else:
            ax.scatter(*xy[mask].T, label=name, color=COLORS[kind], **style)
    for (x, y), text in _labels(xy).items():
        ax.annotate(text, (x, y), xytext=(4, 0), textcoords="offset points", fontsize=5.5,
                    va="center", linespacing=0.9)  # fmt: skip
    lo, hi = float(xy.min()) - 1, float(xy.max()) + 1.5
    ax.set_xlim(lo, hi)
    ax.set_ylim(hi, lo)  # h grows downward, as in the articles
    ax.set_aspect("equal", adjustable="box")
    step = 1 if hi - lo <= 14 else 2 if hi - lo <= 26 else 5
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(MultipleLocator(step))
        axis.set_minor_locator(MultipleLocator(1))
    ax.grid(which="minor", lw=0.3, color="0.88")
    ax.grid(which="major", lw=0.6, color="0.75")
    ax.set_axisbelow(True)
    ax.set_xlabel("w-axis position id", fontsize=8)
    ax.set_ylabel("h-axis position id (down)", fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7, loc="best", markerscale=0.8)
    return mappable


def draw_axes(ax, pos: np.ndarray, kinds: np.ndarray, *, title: str) -> None:
    """Position id on each axis vs token index; visual segments shaded."""
    idx = np.arange(len(pos))
    edges = np.flatnonzero(np.diff(kinds, prepend=-1, append=-1))
    for start, stop in zip(edges[:-1], edges[1:], strict=True):
        if kinds[start] != layouts.TEXT:
            ax.axvspan(start - 0.5, stop - 0.5, color=COLORS[kinds[start]], alpha=0.15, lw=0)
    for a, name in enumerate(axis_names(pos.shape[1])):
        color, ls, lw = AXIS_STYLE.get(name, ("k", "-", 1.2))
        ax.plot(idx, pos[:, a], ls=ls, lw=lw, color=color, marker=".", ms=3, label=f"{name} id")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(lw=0.4, color="0.85")
    ax.set_xlabel("token index (shaded: image / video patches)", fontsize=8)
    ax.set_ylabel("position id", fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7, loc="upper left")


def draw_error(ax, scheme: str, message: str) -> None:
    """A panel that says why `scheme` cannot place the sequence."""
    ax.set_axis_off()
    ax.set_title(scheme, fontsize=9)
    text = textwrap.fill(f"{scheme} cannot place this sequence: {message}", 110)
    ax.text(0.5, 0.5, text, ha="center", va="center", fontsize=9, transform=ax.transAxes,
            bbox=dict(boxstyle="round", fc="0.95", ec="0.6"))  # fmt: skip


def figure(segments, schemes: Sequence[str], num_axes: int, *, command: str = "",
           settings: dict | None = None, allocations: Sequence[str] = (), head_dim: int = 128,
           sections=None):  # fmt: skip
    """One row per scheme, then one for `allocations` if any; returns (Figure,
    {scheme: {"scatter"|"axes"|"error": Axes}, "allocation": {"strip": Axes}})."""
    spec = layouts.format_segments(segments)
    settings = settings or {}
    rows, titles = {}, {}
    for s in schemes:
        own = scheme_settings(s, settings)
        titles[s] = s + "".join(f", {k}={v:g}" for k, v in own.items())
        try:
            rows[s] = layout_points(segments, s, num_axes, **own)
        except ValueError as e:
            rows[s] = str(e)
    cols = ["scatter", "axes"] if num_axes > 1 else ["axes"]
    mosaic = [[f"{s}/{c if not isinstance(rows[s], str) else 'error'}" for c in cols]
              for s in schemes]  # fmt: skip
    heights = [0.3 if isinstance(rows[s], str) else 1.0 for s in schemes]  # error rows: short
    if allocations:
        mosaic.append(["allocation/strip"] * len(cols))
        heights.append(0.2 + 0.08 * len(allocations))
    size = (13 if num_axes > 1 else 9, 5.6 * sum(heights) + 0.4)
    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)
    widths = [1.15, 1] if num_axes > 1 else [1]
    axes = fig.subplot_mosaic(mosaic, width_ratios=widths, height_ratios=heights)
    panels = {}
    for s, row in rows.items():
        if isinstance(row, str):
            draw_error(axes[f"{s}/error"], s, row)
            panels[s] = {"error": axes[f"{s}/error"]}
            continue
        pos, kinds = row
        panels[s] = {"axes": axes[f"{s}/axes"]}
        title = f"{titles[s]}: position id per axis vs token index"
        draw_axes(panels[s]["axes"], pos, kinds, title=title)
        if num_axes > 1:
            panels[s]["scatter"] = ax = axes[f"{s}/scatter"]
            mappable = draw_scatter(ax, pos, kinds, title=f"{titles[s]}   {spec}")
            if mappable is not None:
                bar = fig.colorbar(mappable, ax=ax, shrink=0.8)
                bar.set_label("t-axis id of patch", fontsize=8)
                bar.ax.tick_params(labelsize=7)
                t_ids = np.unique(pos[kinds != layouts.TEXT, 0])
                bar.set_ticks(t_ids if len(t_ids) <= 8 else bar.get_ticks())
    if allocations:
        table = allocation_table(allocations, head_dim, num_axes, sections)
        draw_allocation(axes["allocation/strip"], table, allocations, num_axes)
        panels["allocation"] = {"strip": axes["allocation/strip"]}
    wrapped = textwrap.fill(command or spec, int(size[0] * 13), break_long_words=False)
    fig.suptitle(wrapped, fontsize=8, family="monospace")
    return fig, panels


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m rope_jax.experiments.plot_layout",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--scheme", required=True, help="name, comma-separated names, or 'all'")
    p.add_argument("--segments", required=True, help='e.g. "text:4,image:3x5,text:3"')
    p.add_argument("--num_axes", default=None, help="1, 2 or 3 (default: 3 with a video, else 2)")
    p.add_argument(
        "--out", default=None, help="image; its suffix picks the format (layout_<scheme>.png)"
    )
    p.add_argument(
        "--tokens_per_second",
        default=None,
        help="mrope: temporal ids per second of videos written video:TxHxW@SECONDS",
    )
    p.add_argument("--delta", default=None, help="videorope: temporal id step between frames")
    p.add_argument(
        "--allocation",
        default=None,
        help="rotary allocation name(s), comma-separated, or 'all': adds a pair strip",
    )
    p.add_argument("--head_dim", default=None, help="H of the allocation strip (H/2 pairs; 128)")
    p.add_argument(
        "--sections",
        default=None,
        help="pairs per axis, e.g. 24,20,20 (default: rotary.reference_sections)",
    )
    return p.parse_args(argv)  # fmt: skip


# Every token is a labelled marker: past this the picture is unreadable and slow to draw.
MAX_TOKENS = 2000


def check_args(args) -> tuple[list, list[str], int]:
    """(segments, schemes, num_axes) from the CLI strings; ValueError naming the bad one.
    The layout settings and the allocation strip are checked by `check_extras`."""
    segments = layouts.parse_segments(args.segments)
    if not segments:
        raise ValueError(f"--segments is empty ({args.segments!r}); e.g. text:4,image:3x5")
    count = layouts.num_tokens(segments)
    if count > MAX_TOKENS:
        raise ValueError(f"--segments has {count:,} tokens and patches; plot_layout draws at "
                         f"most {MAX_TOKENS:,} (one labelled marker each): draw a shorter "
                         "sequence")  # fmt: skip
    names = [s.strip() for s in args.scheme.split(",")]
    schemes = list(layouts.SCHEMES) if names == ["all"] else list(dict.fromkeys(names))
    for s in schemes:
        if s not in layouts.SCHEMES:
            raise ValueError(f"unknown scheme {s!r}; allowed: {', '.join(layouts.SCHEMES)}, all")
    video = any(isinstance(s, layouts.Video) for s in segments)
    num_axes = args.num_axes if args.num_axes is not None else str(3 if video else 2)
    if num_axes.strip() not in ("1", "2", "3"):
        raise ValueError(f"--num_axes must be 1, 2 or 3, got {num_axes!r}")
    return segments, schemes, int(num_axes)


def _number(flag: str, text: str, kind=float):
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not value > 0:
        raise ValueError(f"--{flag} must be a positive {kind.__name__}, got {text!r}")
    return value


def check_extras(args, schemes: Sequence[str], num_axes: int) -> dict:
    """{"settings", "allocations", "head_dim", "sections"} from the CLI strings; a setting
    no requested scheme reads, or sections that do not fit, is a ValueError."""
    settings = {}
    for name in layouts.SETTINGS:
        text = getattr(args, name)
        if text is None:
            continue
        settings[name] = _number(name, text)
        readers = layouts.SETTINGS[name]
        if not set(readers) & set(schemes):
            raise ValueError(f"--{name} is read by scheme {', '.join(readers)} only, "
                             f"not by --scheme={args.scheme}")  # fmt: skip
    allocations = []
    if args.allocation is not None:
        names = [a.strip() for a in args.allocation.split(",")]
        allocations = list(rotary.ALLOCATIONS) if names == ["all"] else list(dict.fromkeys(names))
        for a in allocations:
            if a not in rotary.ALLOCATIONS:
                allowed = ", ".join(rotary.ALLOCATIONS)
                raise ValueError(f"unknown allocation {a!r}; allowed: {allowed}, all")
    for flag in ("head_dim", "sections"):
        if getattr(args, flag) is not None and not allocations:
            raise ValueError(f"--{flag} sets the allocation strip, which only --allocation "
                             "draws")  # fmt: skip
    head_dim = _number("head_dim", args.head_dim or "128", int)
    if head_dim % 2:
        raise ValueError(f"--head_dim must be even (pairs), got {args.head_dim!r}")
    sections = None
    if args.sections is not None:
        try:
            sections = tuple(int(v) for v in args.sections.split(","))
        except ValueError:
            raise ValueError(f"--sections must be integers like 24,20,20, got "
                             f"{args.sections!r}") from None  # fmt: skip
    if allocations:
        try:
            allocation_table(allocations, head_dim, num_axes, sections)
        except ValueError as e:
            raise ValueError(f"--allocation: {e}") from None
    return dict(settings=settings, allocations=allocations, head_dim=head_dim, sections=sections)


def command_line(args) -> str:
    """The command that makes this figure, for its suptitle."""
    parts = ["python -m rope_jax.experiments.plot_layout", f"--scheme={args.scheme}"]
    parts.append(f'--segments="{args.segments}"')
    parts += [f"--num_axes={args.num_axes}"] if args.num_axes is not None else []
    for flag in (*layouts.SETTINGS, "allocation", "sections"):
        parts += [f"--{flag}={getattr(args, flag)}"] if getattr(args, flag) is not None else []
    parts += [f"--head_dim={args.head_dim}"] if args.head_dim is not None else []
    return " ".join(parts + ([f"--out={args.out}"] if args.out else []))


def main(argv=None) -> str:
    signals.release_signals()  # one that came while the modules imported: stops it here
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        segments, schemes, num_axes = check_args(args)
        extras = check_extras(args, schemes, num_axes)
        out = args.out or f"layout_{'-'.join(schemes) if args.scheme != 'all' else 'all'}.png"
        report.check_figure_path(out, "--out")
        failed = []
        for s in schemes:
            try:
                layout_points(segments, s, num_axes, **extras["settings"])
            except ValueError as e:
                failed.append(str(e))
        if len(failed) == len(schemes):  # nothing to draw, e.g. one scheme that cannot place it
            raise ValueError("; ".join(failed))
    except ValueError as e:
        sys.exit(f"error: {e}")
    fig, _ = figure(segments, schemes, num_axes, command=command_line(args), **extras)
    report.save_figure(fig, out, dpi=130)
    print(out)
    return out


if __name__ == "__main__":
    main()
