"""matplotlib for the plots that runs write to files."""
from __future__ import annotations


def pyplot():
    """pyplot on the file-only Agg backend (machines without a display), imported when a plot is drawn: half a
    second that every training worker, trial and driver drawing none would otherwise pay at import."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
