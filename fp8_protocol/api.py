"""Where the service's HTTP API lives: every route is under ``API_PREFIX`` on the service root (the
dashboard's `web/js/api.js` spells it again in JavaScript; a test keeps the two equal)."""

from __future__ import annotations

API_PREFIX = "/api/v1"
