"""Matplotlib figures rendered to SVG text (no pyplot state, no files): the pool overview, the trends, and the small
per-query figure (Shapley values with standard errors beside LOO effects and the harm threshold; the interaction
matrix as a heat map)."""

from __future__ import annotations

import base64
import gzip
import io

import matplotlib

matplotlib.use("Agg")
import numpy as np  # noqa: E402
from matplotlib.backends.backend_svg import FigureCanvasSVG  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from pipeline.core.text import safe  # noqa: E402

# Text stays text (svg.fonttype none): a per-query figure is ~12 KB instead of ~60 KB with glyph paths, and the
# fixed hash salt makes the output byte-identical across runs.
RC = {"svg.fonttype": "none", "svg.hashsalt": "meclear", "font.size": 8, "axes.spines.top": False,
      "axes.spines.right": False}
LABEL_ABBREV = {"substitution": "S", "complementarity": "C", "joint_interference": "J", "independent": "",
                "unknown": "?"}


def _plain(s: str, n: int = 18) -> str:
    """A tick label: control and bidi characters escaped (`safe`), truncated, with `$` escaped so matplotlib does not
    read it as mathtext."""
    s = safe(s)
    s = s if len(s) <= n else s[: n - 1] + "…"
    return s.replace("$", r"\$")


def to_svg(fig: Figure) -> str:
    buf = io.StringIO()
    with matplotlib.rc_context(RC):
        # no RDF metadata block: it carries a date (non-reproducible) and namespace URLs
        FigureCanvasSVG(fig).print_svg(buf, metadata={"Creator": None, "Date": None, "Format": None, "Type": None})
    text = buf.getvalue()
    return text[text.index("<svg"):]  # drop the XML prolog and DOCTYPE: the SVG is inlined in HTML


def packed(svg: str) -> str:
    """gzip + base64, unpacked in the browser with DecompressionStream when a query is opened (5-6x smaller)."""
    return base64.b64encode(gzip.compress(svg.encode(), compresslevel=6, mtime=0)).decode("ascii")


def query_figure(rec: dict) -> str:
    mems = rec["memories"]
    k = len(mems)
    with matplotlib.rc_context(RC):
        fig = Figure(figsize=(7.6, 0.45 * k + 1.3))
        ax, hm = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.5, 1]})
        y = np.arange(k)
        phi = np.array([m["shapley"] for m in mems], dtype=float)
        se = np.array([m["se"] or 0.0 for m in mems], dtype=float)
        loo = np.array([m["loo"] for m in mems], dtype=float)
        colors = ["#c0392b" if m["harmful"] else "#2c7fb8" for m in mems]
        ax.barh(y - 0.2, phi, 0.38, xerr=se if se.any() else None, color=colors, label="Shapley (±SE)",
                error_kw={"elinewidth": 0.8, "capsize": 2})
        ax.barh(y + 0.2, loo, 0.38, color="#bbbbbb", label="LOO")
        ax.axvline(-rec["tau"], color="#c0392b", ls="--", lw=0.8, label=f"harm threshold −τ = {-rec['tau']:g}")
        ax.axvline(0, color="black", lw=0.5)
        ax.set_yticks(y, [f"{p}: {_plain(m['id'])}" for p, m in enumerate(mems)])
        ax.invert_yaxis()
        ax.set_xlabel("contribution to v(N) (negative = harmful)")
        ax.legend(loc="lower right", fontsize=6.5, frameon=False)
        m = np.array(rec["matrix"], dtype=float)
        lim = max(float(np.nanmax(np.abs(m))) if np.isfinite(m).any() else 0.0, 1e-9)
        im = hm.imshow(np.ma.masked_invalid(m), cmap="RdBu", vmin=-lim, vmax=lim)
        for i in range(k):
            for j in range(k):
                lab = LABEL_ABBREV.get(rec["labels"][i][j], "")
                if lab:
                    dark = np.isfinite(m[i, j]) and abs(m[i, j]) > lim / 2
                    hm.text(j, i, lab, ha="center", va="center", fontsize=7, color="white" if dark else "black")
        hm.set_xticks(range(k), [str(p) for p in range(k)])
        hm.set_yticks(range(k), [str(p) for p in range(k)])
        hm.set_title(f"pairwise interaction, blue > 0 > red, |max| {lim:.3g}\n"
                     "S substitution  C complement  J joint interference", fontsize=6.5)
        # fixed margins instead of tight_layout and no colorbar axes: tight_layout was 1/3 of the 0.33 s per figure
        fig.subplots_adjust(left=0.2, right=0.98, bottom=0.75 / fig.get_figheight(), top=1 - 0.45 / fig.get_figheight(),
                            wspace=0.25)
        del im
        return to_svg(fig)


def pool_figure(pools: list[dict]) -> str:
    names = [_plain(p["pool"], 14) for p in pools]
    x = np.arange(len(pools))
    with matplotlib.rc_context(RC):
        fig = Figure(figsize=(max(5.0, 0.7 * len(pools) + 2.5), 2.6))
        ax = fig.subplots()
        series = [("queries", "queries", "#cccccc"), ("queries_with_harm", "with harmful memories", "#f39c12"),
                  ("wrong", "answered wrongly", "#c0392b"), ("recovered", "recovered by clearance", "#27ae60")]
        w = 0.8 / len(series)
        for n, (key, label, color) in enumerate(series):
            vals = [p[key] for p in pools]
            bars = ax.bar(x + (n - 1.5) * w, vals, w, label=label, color=color)
            ax.bar_label(bars, fontsize=6, padding=1)  # every bar shows its count, zeros included
        ax.set_xticks(x, names)
        ax.set_ylabel("queries")
        ax.legend(fontsize=7, frameon=False, ncols=4, loc="upper center", bbox_to_anchor=(0.5, 1.18))
        fig.tight_layout()
        return to_svg(fig)


def trend_figure(labels: list[str], series: dict[str, list[dict]]) -> str:
    """series: pool -> per-run pool summaries (None where the pool is absent from a run)."""
    metrics = [("harmful", "harmful memory flags"), ("recovered", "wrong queries recovered"),
               ("evaluations", "agent evaluations")]
    x = np.arange(len(labels))
    with matplotlib.rc_context(RC):
        fig = Figure(figsize=(9.5, 2.6))
        axes = fig.subplots(1, len(metrics))
        for ax, (key, title) in zip(axes, metrics):
            for pool, rows in series.items():
                vals = [np.nan if r is None else r[key] for r in rows]
                ax.plot(x, vals, marker="o", ms=3, lw=1, label=_plain(pool, 14))
            ax.set_title(title, fontsize=8)
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts
            ax.set_xticks(x, [_plain(lbl, 22) for lbl in labels], rotation=20, ha="right", fontsize=6)
            ax.set_xlabel("run (oldest → newest)", fontsize=6.5)
        axes[0].legend(fontsize=6, frameon=False)
        fig.tight_layout()
        return to_svg(fig)
