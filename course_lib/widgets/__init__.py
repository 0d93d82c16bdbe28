"""Interactive figures of the course: ipywidgets sliders over functions that also draw static
matplotlib figures, so every picture works with and without a widget frontend.

Each module draws one lesson's pictures and lists them in its ``FIGURES`` dict (image name ->
function returning a matplotlib Figure).
"""
