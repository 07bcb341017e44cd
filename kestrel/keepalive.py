"""HTTP keep-alive timers shared by `kestrel serve` and Kestrel's own clients of it (rollouts, PD, benchmarks).

uvicorn closes a connection idle for `SERVER_KEEPALIVE_S`. A pooled client must drop its idle connections sooner: with
equal timers (httpx's default expiry is also 5 s) a request sent on a connection as the server closes it dies with
"connection reset by peer", which stopped a 40-minute `kestrel rl` run at step 10.
"""

SERVER_KEEPALIVE_S = 5
CLIENT_KEEPALIVE_S = 2.0
