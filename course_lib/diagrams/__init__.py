"""Diagrams: the pictures of the lessons and the decks that are drawn, not measured.

Each module here is named for its subject and keeps a module-level ``FIGURES = {stem: fn}``
dict, like every figure module of the course; ``course_lib.figures`` finds every module of this
package by itself (``figures.MODULES``), so adding a diagram is adding a function and a stem.
Slide versions of a picture are drawn for the room (few panels, text of at least 18 px on a
1280×720 slide, see ``course_lib.slides.MIN_TEXT_PX``) and carry a ``slides_`` stem prefix.
"""
