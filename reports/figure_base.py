"""Shared helpers of the figure modules (reports.figures_run, figures_compare, figures_sweep):
byte units and their formatting, the colours of memory categories and trace slices, device-range
labels, and a fresh matplotlib figure on the Agg canvas (matplotlib imported lazily, so importing
this module never needs it).
"""
from __future__ import annotations

GIB = float(1 << 30)
#: binary byte units, largest first (the shown unit is picked from the magnitude: byte_unit)
BYTE_UNITS = (("GiB", GIB), ("MiB", float(1 << 20)), ("KiB", float(1 << 10)))


def byte_unit(largest_bytes: float) -> tuple[str, float]:
    """(name, bytes per unit) to show byte counts whose largest is ``largest_bytes``: GiB from
    1 GiB up, MiB from 1 MiB, else KiB — so a CPU run's 5 MiB peak reads 5.00 MiB, not 0.00 GiB."""
    for name, size in BYTE_UNITS:
        if largest_bytes >= size:
            return name, size
    return BYTE_UNITS[-1]


def human_bytes(n: float, digits: int | None = 1) -> str:
    """One byte count in its own unit: 38_755_041_280 -> '36.1 GiB', 3_145_728 -> '3.0 MiB';
    ``digits=None``: three significant digits (25_232_932_864 -> '23.5 GiB', 2**35 -> '32 GiB');
    under 1 KiB, whole bytes ('4 B')."""
    if abs(n) < BYTE_UNITS[-1][1]:
        return f"{n:.0f} B"
    name, size = byte_unit(abs(n))
    return f"{n / size:.3g} {name}" if digits is None else f"{n / size:.{digits}f} {name}"

#: colour and legend label per memory category (Result.devices[*].breakdown)
CATEGORY_STYLE = {
    "parameters_bytes": ("#4c72b0", "parameters"),
    "gradients_bytes": ("#55a868", "gradients"),
    "optimizer_bytes": ("#8172b3", "optimizer state"),
    "activations_bytes": ("#dd8452", "activations"),
    "buffers_bytes": ("#937860", "buffers"),
    "swapped_in_bytes": ("#da8bc3", "swapped in / peer copies"),
    "stashed_weights_bytes": ("#ccb974", "stashed weights"),
}
OTHER_STYLE = ("#bbbbbb", "unattributed")
OOM_COLOUR = "#c0392b"

#: colour per trace slice category ("cat" of the simulator's X events); unknown ones cycle GREYS
SLICE_STYLE = {
    "forward": ("#4c72b0", "forward"),
    "backward": ("#dd8452", "backward"),
    "recompute": ("#8172b3", "recompute"),
    "optimizer_step": ("#7f7f7f", "optimizer step"),
    "p2p": ("#55a868", "p2p send (activations / grads)"),
    "allreduce_grads": ("#17becf", "gradient all-reduce"),
    "swap": ("#c44e52", "swap (d2h / h2d / peer)"),
}
GREYS = ("#aaaaaa", "#666666", "#cccccc")
LANES = ("compute", "comm", "swap")


def new_figure(width_in: float, height_in: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # lazy: specs imports without matplotlib
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_in, height_in), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


#: zlib level of the PNGs (PIL's default is 6): 3 encodes llama3_70b's timeline.png (1300 x 1600) in
#: ~60 ms instead of ~100 ms for a file ~10 % larger; the pixels are the same at any level
PNG_COMPRESS_LEVEL = 3
#: what write_png passes to PIL, as savefig's ``pil_kwargs`` would
PNG_KWARGS = {"compress_level": PNG_COMPRESS_LEVEL}

#: the rcParams at their defaults, under which ``Figure.savefig(path, format="png", pil_kwargs=PNG_KWARGS)``
#: of a figure from :func:`new_figure` is one draw of its Agg canvas + ``matplotlib.image.imsave`` (write_png)
_PLAIN_SAVEFIG = {"savefig.dpi": "figure", "savefig.bbox": None, "savefig.facecolor": "auto",
                  "savefig.edgecolor": "auto", "savefig.transparent": False}


def write_png(fig, path) -> None:
    """Write ``fig`` as PNG: the bytes ``fig.savefig(path, format="png", pil_kwargs=PNG_KWARGS)``
    writes, drawn once. savefig first draws a figure that has a layout engine with drawing
    disabled (to run the constrained layout), then draws it again for real; ``canvas.draw()`` runs
    the layout and draws in one pass, and ``image.imsave`` is what savefig's Agg PNG writer calls on
    that buffer (a tenth of a second less for llama3_70b's two figures). A canvas other than Agg or
    a matplotlibrc that changes savefig's defaults goes through savefig itself."""
    import matplotlib as mpl
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    if type(fig.canvas) is not FigureCanvasAgg or any(mpl.rcParams[k] != v for k, v in _PLAIN_SAVEFIG.items()):
        fig.savefig(path, format="png", pil_kwargs=dict(PNG_KWARGS))
        return
    fig.canvas.draw()  # savefig marks the canvas as saving: that only matters to animated artists (none here)
    mpl.image.imsave(path, fig.canvas.buffer_rgba(), format="png", origin="upper", dpi=fig.dpi,
                     pil_kwargs=dict(PNG_KWARGS))


def device_ranges(devices: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    parts, start = [], devices[0]
    for prev, cur in zip(devices, devices[1:] + [None]):
        if cur is None or cur != prev + 1:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = cur
    return ",".join(parts)


#: below this share of the capacity the bars would be a few pixels: scale to the peaks instead
CAPACITY_OFF_SCALE = 0.05
