"""fp8scope monitor service."""
