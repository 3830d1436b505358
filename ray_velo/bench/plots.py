"""Throughput against payload size from committed sittings, one panel per link: ray_velo beside
Ray's object store (and NIXL, in tensor-transport sittings) and the raw link, each point the
median over the sittings with their range as a bar (``ray-velo bench --ranges FILES --plot
PNG``; the README's picture)."""

from __future__ import annotations

import re
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["plot_sittings"]

MiB = 1 << 20
#: A shape named by its size and link: "256 MiB @10gbit", "1.5 GiB unshaped",
#: "16 MiB tensor, @none", "4 MiB tensor, local nodes".
_SIZED = re.compile(r"^([\d.]+) (MiB|GiB)(?: tensor,)? @?(\d+[gm]bit|none|unshaped|local nodes)$")
_LINK_NAMES = {
    "none": "unshaped link",
    "unshaped": "unshaped link",
    "local nodes": "two local nodes (UCX cma)",
}
_LABELS = {
    "ray": "Ray's object store",
    "torch_plain": "Ray's object store",
    "torch_nixl": "NIXL",
    "velo": "ray_velo",
    "torch_velo": "ray_velo (VELO)",
    "raw_tcp": "raw link (one TCP socket)",
}
_STYLE = {"ray_velo": "C0", "ray_velo (VELO)": "C0", "Ray's object store": "C3", "NIXL": "C2"}


def _points(
    sittings: Sequence[Mapping[str, Any]],
) -> dict[str, dict[str, dict[float, list[float]]]]:
    """``{link: {label: {MiB: [GB/s per sitting]}}}`` of every sized shape."""
    out: dict[str, dict[str, dict[float, list[float]]]] = {}
    for sitting in sittings:
        for name, columns in sitting["shapes"].items():
            match = _SIZED.match(name)
            if match is None:
                continue
            mib = float(match.group(1)) * (1024 if match.group(2) == "GiB" else 1)
            link = _LINK_NAMES.get(match.group(3), f"{match.group(3)} link")
            for column, label in _LABELS.items():
                seconds = columns.get(column)
                if seconds:
                    gbps = mib * MiB / seconds / 1e9
                    out.setdefault(link, {}).setdefault(label, {}).setdefault(mib, []).append(gbps)
    return out


def plot_sittings(sittings: Sequence[Mapping[str, Any]], path: str, title: str) -> None:
    """A PNG at ``path``: GB/s against payload size, a panel per link.

    Raises:
        ValueError: no shape of the sittings is named by a size and a link.
        ImportError: matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    points = _points(sittings)
    if not points:
        raise ValueError("no shape of these sittings has a size and a link to plot")
    links = sorted(points, key=lambda link: (link.startswith("unshaped"), link))
    fig, axes = plt.subplots(1, len(links), figsize=(6 * len(links), 4.5), squeeze=False)
    for ax, link in zip(axes[0], links, strict=True):
        for label, by_size in points[link].items():
            sizes = sorted(by_size)
            mid = [statistics.median(by_size[s]) for s in sizes]
            low = [m - min(by_size[s]) for m, s in zip(mid, sizes, strict=True)]
            high = [max(by_size[s]) - m for m, s in zip(mid, sizes, strict=True)]
            dashed = "--" if label.startswith("raw") else "-"
            ax.errorbar(
                sizes, mid, yerr=[low, high], marker="o", capsize=3, linestyle=dashed,
                label=label, color=_STYLE.get(label, "0.4"),
            )  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.set_xlabel("payload (MiB)")
        ax.set_ylabel("GB/s, end to end")
        ax.set_title(link)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
