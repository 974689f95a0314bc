"""The policy servers' API key for flows: a Prefect Secret block (deployments) or CLOTHO_API_KEY."""

from __future__ import annotations

import os

API_KEY_VARIABLE = "CLOTHO_API_KEY"


async def resolve_api_key(api_key_secret: str | None) -> str | None:
    """The policy servers' API key: the Prefect Secret block named `api_key_secret` (deployments),
    else $CLOTHO_API_KEY of this process (`clotho rollout --api-key` sets it). Never a flow
    parameter: parameters are stored with the flow run and shown in the UI."""
    if api_key_secret:
        from prefect.blocks.system import Secret

        try:
            secret = await Secret.aload(api_key_secret)
        except ValueError as error:
            raise ValueError(
                f"api_key_secret={api_key_secret!r}: no such Secret block ({error}); create it with "
                f"`prefect block create secret` or Secret(value=KEY).save({api_key_secret!r})"
            ) from None
        return secret.get()
    return os.environ.get(API_KEY_VARIABLE) or None
