"""vLLM middleware: the API key guards every route, the dev routes too (vLLM's own check skips them).

vLLM 0.32's --api-key only covers paths under /v1, /v2, /inference and /cohere, so /collective_rpc,
/pause or /update_weight_version stay open to anyone who can reach the port. Loaded with
`--middleware clotho_auth.require_api_key`; the key comes from VLLM_API_KEY. Imports only what vLLM
already has: it runs in the server's environment, not clotho's.
"""

import hmac
import os

from starlette.responses import JSONResponse

# The health probe carries no credentials (load balancers, PolicyServer.wait_healthy).
OPEN_PATHS = {"/health"}


async def require_api_key(request, call_next):
    key = os.environ.get("VLLM_API_KEY", "")
    if request.method == "OPTIONS" or request.url.path in OPEN_PATHS:
        return await call_next(request)
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    # No key configured means nothing is accepted: this middleware is only loaded to require one.
    if not key or scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), key.encode()):
        return JSONResponse({"error": "Unauthorized: send 'Authorization: Bearer <api key>'"}, status_code=401)
    return await call_next(request)
