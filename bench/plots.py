"""The report's plots (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional, Sequence

from .tables import BASELINE, LABEL, methods_present, speedup

def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _label(ax, xlabel: str, ylabel: str, legend_size: int = 7) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_size)


def save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return path


def plot_speedup_bars(rows: Sequence[Mapping], path: Path, setting: str = "1n-full",
                      model: str = "8B") -> Optional[Path]:
    sel = [r for r in rows if r["setting"] == setting and r["model"] == model]
    if not sel:
        return None
    plt = pyplot()
    methods = [(k, h) for k, h in methods_present(sel) if k != BASELINE]
    fig, axes = plt.subplots(1, len(sel), figsize=(3.2 * len(sel), 4.2), sharey=True, squeeze=False)
    for ax, r in zip(axes[0], sel):
        xs = [speedup(r, k) or 0.0 for k, _ in methods]
        colors = ["tab:red" if k.startswith("odb") else "tab:gray" for k, _ in methods]
        ax.barh(range(len(methods)), xs, color=colors)
        ax.set_yticks(range(len(methods)))
        ax.set_yticklabels([h for _, h in methods], fontsize=7)
        ax.axvline(1.0, color="k", lw=0.8)
        if r.get("paper"):
            ax.axvline(r["paper"].odb_speedup, color="tab:blue", ls="--", lw=1.2, label="paper ODB")
            ax.legend(fontsize=7, loc="lower right")
        ax.set_title(f"{r['workload']}\nCV {r['cv']:.2f}, f_s {r['f_s']:.2f}", fontsize=8)
        ax.set_xlabel("speedup vs Standard bs=1", fontsize=8)
    fig.suptitle(f"Simulated speedup, Qwen3-VL-{model}, {sel[0]['setting_label']} (8×H20 model)", fontsize=9)
    return save(fig, path)


def plot_sweeps(cv_rows: Sequence[Mapping], fs_rows: Sequence[Mapping], path: Path) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, rows, key, label in ((axes[0], cv_rows, "cv", "length CV"),
                                 (axes[1], fs_rows, "f_s", "short-sample fraction f_s (≤512 tokens)")):
        series = [k for k in dict.fromkeys(k for r in rows for k in r) if k.startswith("x_")]
        for col in series:
            pts = sorted((r[key], r[col]) for r in rows if r.get(col))
            name = col[2:].replace("_2b_2n", "")
            legend = LABEL.get(name, name) + (" (2B, 2 nodes)" if col.endswith("_2b_2n") else " (8B, 1 node)")
            if pts:
                ax.plot(*zip(*pts), marker="o", ls="--" if col.endswith("_2b_2n") else "-", label=legend)
        _label(ax, label, "speedup vs Standard bs=1", legend_size=8)
    return save(fig, path)


def plot_lines(rows: Sequence[Mapping], x: str, y: str, group: str, path: Path, xlabel: str,
               ylabel: str, logx: bool = False) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for g in dict.fromkeys(r[group] for r in rows):
        pts = [(r[x], r[y]) for r in rows if r[group] == g and r.get(y) is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=g)
    if logx:
        ax.set_xscale("log", base=2)
    _label(ax, xlabel, ylabel)
    return save(fig, path)
