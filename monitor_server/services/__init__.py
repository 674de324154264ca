"""Services: what the routes ask for, run over storage and the detectors; each takes its collaborators."""
