"""What a run is, as both sides say it."""

from __future__ import annotations

import re
from typing import Any

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


def check_tags(tags: Any) -> list[str]:
    """The tags sorted and without repeats; ValueError naming the first that is not a tag (``TAG_PATTERN``)
    or saying there are more than ``MAX_TAGS``."""
    if isinstance(tags, str):
        raise ValueError(f"tags: expected a list of strings, got the string {tags!r}")
    unique: list[str] = sorted(set(tags))
    bad = [t for t in unique if not isinstance(t, str) or not re.match(TAG_PATTERN, t)]
    if bad:
        raise ValueError(f"tags: {bad[0]!r} is not a tag (1-64 letters, digits or _-.:/=+@)")
    if len(unique) > MAX_TAGS:
        raise ValueError(f"tags: at most {MAX_TAGS}, got {len(unique)}")
    return unique
