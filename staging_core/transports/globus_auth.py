"""Globus login for pallet: a native-app UserApp (globus-sdk 4), its tokens in a 0600 JSON file.

The file is under the XDG config dir.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import globus_sdk
from globus_sdk.globus_app.config import resolve_by_login_flow
from globus_sdk.token_storage import JSONTokenStorage

from bundles.errors import UsageError

from .errors import AuthenticationError

CLIENT_ID_ENV = "PALLET_GLOBUS_CLIENT_ID"
APP_NAME = "pallet"
_REGISTER_HINT = (f"register a native app (\"thick client\") at https://app.globus.org/settings/developers "
                  f"and export {CLIENT_ID_ENV}=ITS_CLIENT_ID, or pass --client-id")


def token_path() -> str:
    """Where the Globus tokens live: $XDG_CONFIG_HOME/pallet/globus-tokens.json (~/.config by default)."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "pallet", "globus-tokens.json")


def resolve_client_id(client_id: str | None = None) -> str:
    """The native-app client id: the argument, else $PALLET_GLOBUS_CLIENT_ID; UsageError if neither."""
    value = client_id or os.environ.get(CLIENT_ID_ENV, "").strip()
    if not value:
        raise UsageError("no Globus client id is configured", hint=_REGISTER_HINT)
    return value


def make_app(client_id: str | None = None, path: str | None = None, interactive: bool = False) -> globus_sdk.UserApp:
    """A UserApp storing refresh tokens in ``path``; only an interactive app may start a login flow by itself."""
    path = path or token_path()
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    config = globus_sdk.GlobusAppConfig(
        token_storage=JSONTokenStorage(path), request_refresh_tokens=True, login_flow_manager="command-line",
        token_validation_error_handler=resolve_by_login_flow if interactive else None)
    return globus_sdk.UserApp(APP_NAME, client_id=resolve_client_id(client_id), config=config)


def login(client_id: str | None = None, collections: Sequence[str] = (), path: str | None = None) -> str:
    """Run the native-app login flow (URL printed, code read from stdin); store the tokens; return the file.

    ``collections`` are GCS v5 mapped collections that need a ``data_access``
    consent. The token file is made mode 0600; no token is ever printed.
    """
    path = path or token_path()
    with make_app(client_id, path, interactive=True) as app:
        client = globus_sdk.TransferClient(app=app)
        if collections:
            client.add_app_data_access_scope(list(collections))
        try:
            app.login(force=True)
        except EOFError:
            raise UsageError("no authorization code was entered",
                             hint="run `pallet login globus` in an interactive terminal") from None
        except globus_sdk.GlobusAPIError as exc:
            raise AuthenticationError(f"Globus refused the login ({exc.code or exc.http_status})",
                                      hint="run `pallet login globus` again and paste a fresh code") from None
    os.chmod(path, 0o600)
    return path


def transfer_client(client_id: str | None = None, collections: Sequence[str] = (),
                    path: str | None = None) -> globus_sdk.TransferClient:
    """A TransferClient using the stored tokens (refreshed as needed); never prompts.

    Raises AuthenticationError naming `pallet login globus` when no usable
    tokens are stored.
    """
    path = path or token_path()
    app = make_app(client_id, path)
    client = globus_sdk.TransferClient(app=app)
    if collections:
        client.add_app_data_access_scope(list(collections))
    if not os.path.exists(path) or app.login_required():
        app.close()
        raise AuthenticationError("not logged in to Globus, or the login has expired", path,
                                  hint="run `pallet login globus` once on this host")
    return client
