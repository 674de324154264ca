"""What a run is, as both sides say it."""

from __future__ import annotations

#: A run's status. ``interrupted``: stopped by the user (Ctrl-C); ``halted``: stopped by the job itself at
#: a non-finite loss (``fp8-train --halt-on-nonfinite``); ``crashed``: ended by an exception.
RUN_STATUSES: tuple[str, ...] = ("running", "finished", "crashed", "interrupted", "halted")
#: The statuses a run ends with.
FINAL_STATUSES: tuple[str, ...] = tuple(s for s in RUN_STATUSES if s != "running")

#: A tag: 1 to 64 characters of letters, digits and ``_ - . : / = + @`` (no spaces: tags are typed into a
#: filter box and into URLs).
TAG_PATTERN = r"^[\w.:/=+@-]{1,64}$"
#: Tags per run.
MAX_TAGS = 32
