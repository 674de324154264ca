"""Infrastructure: the request guard, HTTP protocol, event broker, webhook, metrics and static files."""
