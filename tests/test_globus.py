"""Globus transport and login: the real globus-sdk 4 client against globus_sdk.testing responses and a byte-moving
stand-in."""
from __future__ import annotations

import io
import json
import logging
import os
import time
import uuid
from types import SimpleNamespace

import globus_sdk
import jwt
import pytest
import responses
from cryptography.hazmat.primitives.asymmetric import rsa
from globus_sdk.testing import RegisteredResponse, load_response
from globus_sdk.transport import RetryConfig

from bundles.errors import UsageError
from staging_core.cli import main as cli
from staging_core.testing import ConformanceTarget, TransportConformance
from staging_core.transports import globus as globus_module
from staging_core.transports import globus_auth
from staging_core.transports.base import Direction, local_tree_items
from staging_core.transports.errors import (AuthenticationError, HostUnreachableError, NotSupportedError,
                                            RemoteDiskFullError, RemotePathMissingError, RemotePermissionError,
                                            TransportError)
from staging_core.transports.globus_mapping import classify_globus
from staging_core.transports.registry import open_transport
from tests.globus_standin import API, GlobusStandIn

LOCAL, REMOTE = str(uuid.uuid4()), str(uuid.uuid4())
FAST = {"poll_interval": 0.001, "poll_max_interval": 0.004}


@pytest.fixture
def mock():
    """Every HTTP request of the test goes to `responses`; anything unregistered fails as a connection error."""
    with responses.RequestsMock(assert_all_requests_are_fired=False) as requests_mock:
        yield requests_mock


def sdk_client() -> globus_sdk.TransferClient:
    return globus_sdk.TransferClient(authorizer=globus_sdk.AccessTokenAuthorizer("stand-in-token"),
                                     retry_config=RetryConfig(max_retries=0))


@pytest.fixture
def site(mock, tmp_path, tmp_path_factory):
    """tmp_path is the local collection's root (this host), a second directory the remote collection's."""
    remote = tmp_path_factory.mktemp("globus-remote")
    standin = GlobusStandIn(mock, {LOCAL: str(tmp_path), REMOTE: str(remote)})

    def transport(**options):
        return open_transport(f"globus://{REMOTE}/", local_endpoint=LOCAL, client=sdk_client(),
                              local_collection_root=str(tmp_path), **{**FAST, **options})
    return SimpleNamespace(standin=standin, local=tmp_path, remote=remote, transport=transport, mock=mock)


def calls(mock, method: str, path: str) -> list:
    return [c for c in mock.calls if c.request.method == method and c.request.url.split("?")[0] == API + path]


def make_files(root, count: int, per_dir: int = 50) -> list[str]:
    for n in range(count):
        path = root / f"d{n // per_dir}" / f"f{n:04d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"payload %d\n" % n * (n % 7 + 1))
        os.utime(path, (1_700_000_000 + n, 1_700_000_000 + n))
    return local_tree_items(str(root))


class TestGlobusConformance(TransportConformance):
    """The shipped suite through the stand-in (symlinks=False: the suite leaves link items out; see below)."""

    scheme = "globus"

    @pytest.fixture
    def conformance_target(self, site):
        return ConformanceTarget(site.transport(), "/conformance")


# ---------------------------------------------------------------- one task per batch

def test_a_batch_of_files_is_one_task_with_one_submission_id(site):
    items = make_files(site.local / "data", 200)
    transport = site.transport(sync_level="checksum", verify_checksum=True)
    result = transport.transfer(Direction.PUSH, str(site.local / "data"), "/staged", items)
    assert result.ok and result.done == items
    assert len(calls(site.mock, "POST", "/transfer")) == 1 and len(site.standin.submission_ids_issued) == 1
    body = site.standin.submissions[0]
    assert len(body["DATA"]) == 200 and all("recursive" not in item for item in body["DATA"])
    assert (body["sync_level"], body["verify_checksum"], body["preserve_timestamp"]) == (3, True, True)
    assert body["source_endpoint"] == LOCAL and body["destination_endpoint"] == REMOTE
    assert len(calls(site.mock, "GET", f"/task/{next(iter(site.standin.tasks))}")) >= 2     # polled until done
    for item in items[4:]:
        local, remote = site.local / "data" / item, site.remote / "staged" / item
        assert remote.read_bytes() == local.read_bytes() and int(remote.stat().st_mtime) == int(local.stat().st_mtime)
    back = transport.transfer(Direction.PULL, str(site.local / "back"), "/staged", items)
    assert back.ok and len(calls(site.mock, "POST", "/transfer")) == 2
    assert all((site.local / "back" / i).read_bytes() == (site.local / "data" / i).read_bytes() for i in items[4:])


def test_sync_level_reaches_the_service(site):
    items = make_files(site.local / "data", 20)
    transport = site.transport(sync_level="size")
    transport.transfer(Direction.PUSH, str(site.local / "data"), "/s", items)
    again = transport.transfer(Direction.PUSH, str(site.local / "data"), "/s", items)
    assert again.ok and len(again.done) == len(items)
    second = list(site.standin.tasks.values())[1]
    assert second["files_skipped"] == 20 and second["successful"] == []


def test_retried_submit_reuses_the_submission_id_and_makes_one_task(site):
    items = make_files(site.local / "data", 5)
    site.standin.lose_submit_responses = 1          # the first submit is accepted but its answer is lost (503)
    result = site.transport().transfer(Direction.PUSH, str(site.local / "data"), "/r", items)
    assert result.ok
    first, second = site.standin.submissions
    assert first["submission_id"] == second["submission_id"] == site.standin.submission_ids_issued[0]
    assert len(site.standin.submission_ids_issued) == 1 and len(site.standin.tasks) == 1
    assert json.loads(calls(site.mock, "POST", "/transfer")[1].response.text)["code"] == "Duplicate"


def test_submit_gives_up_after_its_attempts_without_a_second_task(site):
    items = make_files(site.local / "data", 3)
    site.standin.lose_submit_responses = 5
    with pytest.raises(TransportError) as caught:
        site.transport(submit_attempts=2).transfer(Direction.PUSH, str(site.local / "data"), "/r", items)
    assert caught.value.retryable and "submit" in str(caught.value)
    assert len({s["submission_id"] for s in site.standin.submissions}) == 1 and len(site.standin.tasks) == 1


# ---------------------------------------------------------------- failures

def test_skipped_source_errors_fail_alone(site):
    items = make_files(site.local / "data", 3)
    files = [i for i in items if i.endswith(".txt")]
    site.standin.before_run = lambda: os.unlink(site.local / "data" / files[0])     # vanishes after planning
    site.standin.denied.add((LOCAL, f"/data/{files[1]}"))                          # a collection ACL denies it
    result = site.transport().transfer(Direction.PUSH, str(site.local / "data"), "/k", items)
    assert result.done == ["d0", files[2]]
    assert isinstance(result.failed[files[0]], RemotePathMissingError)
    assert isinstance(result.failed[files[1]], RemotePermissionError)
    assert "FILE_NOT_FOUND" in str(result.failed[files[0]]) and files[1] in str(result.failed[files[1]])


def test_failed_task_names_its_cause_per_item(site):
    items = [i for i in make_files(site.local / "data", 5) if i.endswith(".txt")]
    sizes = [(site.local / "data" / i).stat().st_size for i in items]
    site.standin.quota[REMOTE] = sum(sizes[:2])
    result = site.transport().transfer(Direction.PUSH, str(site.local / "data"), "/q", items)
    assert result.done == items[:2] and list(result.failed) == items[2:]
    error = result.failed[items[3]]
    assert isinstance(error, RemoteDiskFullError) and "QUOTA_EXCEEDED" in str(error) and "failed" in str(error)
    assert error.path == items[3]


def test_destination_denied_fails_fast_and_cancels_the_task(site):
    items = make_files(site.local / "data", 3)
    site.standin.denied.add((REMOTE, "/locked"))
    with pytest.raises(RemotePermissionError, match="PERMISSION_DENIED"):
        site.transport().transfer(Direction.PUSH, str(site.local / "data"), "/locked", items)
    assert all(task.get("cancelled") for task in site.standin.tasks.values())


def test_inactive_task_is_an_authentication_error(site):
    items = make_files(site.local / "data", 2)
    site.standin.stuck = ("INACTIVE", "CREDENTIAL_EXPIRED")
    with pytest.raises(AuthenticationError) as caught:
        site.transport().transfer(Direction.PUSH, str(site.local / "data"), "/i", items)
    assert "pallet login globus" in str(caught.value) and next(iter(site.standin.tasks.values()))["cancelled"]


def test_polling_backs_off_until_the_deadline(site, monkeypatch):
    items = make_files(site.local / "data", 2)
    site.standin.stuck = ("ACTIVE", "OK")
    delays, real_sleep = [], time.sleep
    monkeypatch.setattr(globus_module.time, "sleep", lambda s: (delays.append(s), real_sleep(s)))
    transport = site.transport(poll_interval=0.001, poll_max_interval=0.008, timeout=0.1)
    with pytest.raises(TransportError, match="did not finish within") as caught:
        transport.transfer(Direction.PUSH, str(site.local / "data"), "/t", items)
    assert caught.value.retryable and delays[:4] == [0.001, 0.002, 0.004, 0.008] and max(delays) == 0.008
    assert next(iter(site.standin.tasks.values()))["cancelled"]
    assert site.standin.submissions[0]["deadline"].endswith("+00:00")


def test_links_and_crlf_names_fail_alone_and_whole_trees_skip_links(site):
    data = site.local / "data"
    items = make_files(data, 2)
    (data / "link").symlink_to("d0/f0000.txt")
    (data / "cr\r\nlf").write_bytes(b"refused by Globus")
    result = site.transport().transfer(Direction.PUSH, str(data), "/l", [*items, "link", "cr\r\nlf"])
    assert result.done == items and list(result.failed) == ["link", "cr\r\nlf"]
    assert all(isinstance(error, NotSupportedError) for error in result.failed.values())
    assert not (site.remote / "l" / "link").exists()
    (data / "cr\r\nlf").unlink()
    whole = site.transport().transfer(Direction.PUSH, str(data), "/w", None)
    assert whole.ok and whole.done == ["."] and not (site.remote / "w" / "link").exists()
    assert (site.remote / "w" / "d0" / "f0001.txt").read_bytes() == (data / "d0" / "f0001.txt").read_bytes()
    (site.remote / "w" / "rlink").symlink_to("d0/f0000.txt")
    pulled = site.transport().transfer(Direction.PULL, str(site.local / "back"), "/w", ["rlink", "d0/f0000.txt"])
    assert pulled.done == ["d0/f0000.txt"] and isinstance(pulled.failed["rlink"], NotSupportedError)


@pytest.mark.parametrize("code, cls", [
    ("ClientError.NotFound", RemotePathMissingError),
    ("ExternalError.DirListingFailed.NotFound", RemotePathMissingError),
    ("EndpointPermissionDenied", RemotePermissionError), ("PERMISSION_DENIED", RemotePermissionError),
    ("ConsentRequired", AuthenticationError), ("EndpointNotActivated", AuthenticationError),
    ("AuthenticationFailed", AuthenticationError), ("QUOTA_EXCEEDED", RemoteDiskFullError),
    ("ExternalError.DirListingFailed.GCDisconnected", HostUnreachableError), ("InvalidPath", NotSupportedError)])
def test_globus_codes_map_to_transport_errors(code, cls):
    assert type(classify_globus(code, "detail")) is cls


def test_api_errors_from_canned_responses(mock):
    endpoint = load_response("transfer.operation_stat", case="not_found", requests_mock=mock).metadata["endpoint_id"]
    transport = open_transport(f"globus://{endpoint}/", local_endpoint=LOCAL, client=sdk_client())
    assert transport.stat("/~/foo") is None
    load_response("transfer.operation_stat", case="permission_denied", requests_mock=mock).replace(requests_mock=mock)
    with pytest.raises(RemotePermissionError, match="EndpointPermissionDenied"):
        transport.stat("/foo")
    RegisteredResponse(service="transfer", path=f"/v0.10/operation/endpoint/{endpoint}/ls", status=403,
                       json={"code": "ConsentRequired", "message": "Missing required data_access consent",
                             "required_scopes": ["urn:globus:auth:scope:transfer.api.globus.org:all"]}).add(
        requests_mock=mock)
    with pytest.raises(AuthenticationError, match="--collection"):
        transport.list("/data")
    with pytest.raises(HostUnreachableError):                   # nothing registered: no network at all
        transport.mkdir("/new")


def test_mkdir_makes_parents_and_accepts_existing_and_list_pages(site, monkeypatch):
    transport = site.transport()
    transport.mkdir("/a/b/c")
    transport.mkdir("/a/b/c")
    assert (site.remote / "a" / "b" / "c").is_dir() and transport.stat("/a/b").kind == "d"
    for n in range(7):
        (site.remote / "a" / f"f{n}").write_bytes(b"x" * n)
    monkeypatch.setattr(globus_module, "_LS_LIMIT", 3)
    listed = {e.path: e for e in transport.list("/a")}
    assert set(listed) == {"b", "b/c", *(f"f{n}" for n in range(7))} and listed["f6"].size == 6
    with pytest.raises(RemotePathMissingError):
        transport.list("/nowhere")


def test_configuration_errors_are_usage_errors(site, monkeypatch):
    monkeypatch.delenv(globus_module.LOCAL_ENDPOINT_ENV, raising=False)
    with pytest.raises(UsageError, match="local_endpoint"):
        open_transport(f"globus://{REMOTE}/", client=sdk_client())
    with pytest.raises(UsageError, match="UUID"):
        open_transport("globus://not-a-uuid/", local_endpoint=LOCAL, client=sdk_client())
    with pytest.raises(UsageError, match="outside the local collection root"):
        site.transport().transfer(Direction.PUSH, "/etc", "/x", ["hosts"])


# ---------------------------------------------------------------- login

CLIENT_ID = str(uuid.uuid4())
SECRETS = {"auth_access": "AUTH-ACCESS-7f3a", "auth_refresh": "AUTH-REFRESH-91bc",
           "transfer_access": "TRANSFER-ACCESS-5d2e", "transfer_refresh": "TRANSFER-REFRESH-c48f"}


def _register_auth(mock) -> str:
    """Globus Auth for one login: OIDC configuration, a JWK and a code exchange returning a signed id_token."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key()))
    now = int(time.time())
    id_token = jwt.encode({"sub": str(uuid.uuid4()), "aud": CLIENT_ID, "iss": "https://auth.globus.org", "iat": now,
                           "exp": now + 600, "preferred_username": "someone@example.org"}, key, algorithm="RS512")
    tokens = {"access_token": SECRETS["auth_access"], "refresh_token": SECRETS["auth_refresh"], "id_token": id_token,
              "scope": "openid", "resource_server": "auth.globus.org", "expires_in": 172800, "token_type": "Bearer",
              "state": "_default",
              "other_tokens": [{"access_token": SECRETS["transfer_access"],
                                "refresh_token": SECRETS["transfer_refresh"],
                                "scope": "urn:globus:auth:scope:transfer.api.globus.org:all", "expires_in": 172800,
                                "resource_server": "transfer.api.globus.org", "token_type": "Bearer",
                                "state": "_default"}]}
    for path, method, body in (("/.well-known/openid-configuration", "GET",
                                {"issuer": "https://auth.globus.org", "jwks_uri": "https://auth.globus.org/jwk.json",
                                 "id_token_signing_alg_values_supported": ["RS512"]}),
                               ("/jwk.json", "GET", {"keys": [jwk]}), ("/v2/oauth2/token", "POST", tokens)):
        RegisteredResponse(service="auth", path=path, method=method, json=body).add(requests_mock=mock)
    return id_token


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv(globus_auth.CLIENT_ID_ENV, CLIENT_ID)
    return tmp_path / "config" / "pallet" / "globus-tokens.json"


def test_login_stores_tokens_privately_and_prints_none(mock, home, monkeypatch, capsys, caplog):
    id_token = _register_auth(mock)
    monkeypatch.setattr("sys.stdin", io.StringIO("fake-auth-code\n"))
    caplog.set_level(logging.DEBUG)
    assert cli.main(["login", "globus"]) == 0
    out, err = capsys.readouterr()
    assert "https://auth.globus.org/v2/oauth2/authorize" in out and str(home) in out
    exchange = [c for c in mock.calls if c.request.url.endswith("/v2/oauth2/token")]
    assert len(exchange) == 1 and "code=fake-auth-code" in exchange[0].request.body
    assert home.exists() and (home.stat().st_mode & 0o777) == 0o600
    assert SECRETS["transfer_refresh"] in home.read_text()
    for secret in [*SECRETS.values(), id_token]:
        assert secret not in out and secret not in err and secret not in caplog.text
    client = globus_auth.transfer_client()                  # the stored tokens drive the transport's client
    load_response("transfer.get_submission_id", requests_mock=mock)
    client.get_submission_id()
    assert mock.calls[-1].request.headers["Authorization"] == f"Bearer {SECRETS['transfer_access']}"


def test_without_login_the_transport_says_how(mock, home):
    with pytest.raises(AuthenticationError, match="pallet login globus"):
        open_transport(f"globus://{REMOTE}/", local_endpoint=LOCAL)
    assert not any("globus.org" in c.request.url for c in mock.calls)


def test_login_without_client_id_or_code_is_a_usage_error(mock, home, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    with pytest.raises(SystemExit) as caught:
        cli.main(["login", "globus"])
    assert caught.value.code == 2 and "no authorization code" in capsys.readouterr().err
    monkeypatch.delenv(globus_auth.CLIENT_ID_ENV)
    with pytest.raises(SystemExit):
        cli.main(["login", "globus"])
    assert globus_auth.CLIENT_ID_ENV in capsys.readouterr().err
