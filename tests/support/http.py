"""One HTTP client for the tests' plain requests to server processes: `loopback.get(...)` where one would
write `httpx.get(...)`.

`httpx.get` and its siblings build a client for every call, and with it an SSL context that loads the CA
bundle: about 17 ms of CPU each time, even for plain http. The suite made thousands of such calls (a server
start polls /healthz every 0.1 s, helpers read a run's heatmap or alerts), about a minute and a half of CPU
in all. This client is built once per process and keeps each call as independent as `httpx.get` made it:
no keep-alive (a request opens its own loopback connection, so a server stopped, killed or restarted
between two requests never meets a pooled connection), no cookies kept, httpx's default timeout of 5 s,
and no cap on connections open at once (threads posting together each get their own).
"""

from __future__ import annotations

from http.cookiejar import CookieJar, DefaultCookiePolicy

import httpx

#: refuses every cookie a response sets: a request never carries what an earlier one was given
_NO_COOKIES = CookieJar(policy=DefaultCookiePolicy(allowed_domains=[]))

loopback = httpx.Client(
    limits=httpx.Limits(max_connections=None, max_keepalive_connections=0),
    timeout=httpx.Timeout(5.0),
    cookies=_NO_COOKIES,
)
