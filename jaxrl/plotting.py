"""matplotlib's pyplot on its file-only backend (Agg), imported when a figure is drawn.

Importing pyplot takes about 0.2 s, which every ``jaxrl`` process would otherwise pay at start-up,
figures or not (``logging.plots=false``, ``jaxrl compile``, a tool worker).
"""

from jaxrl.errors import needs_extra


def pyplot():
    """``matplotlib.pyplot`` with the Agg backend chosen first (PNG files; no display needed).
    Without matplotlib (the [train] extra): ``MissingExtraError`` naming the extra."""
    with needs_extra("jaxrl.plotting"):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str, dpi: int) -> str:
    """Writes ``fig`` to ``path`` (PNG at ``dpi``), laid out tight, and closes it; returns ``path``."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path
