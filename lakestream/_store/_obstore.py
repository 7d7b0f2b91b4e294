"""`s3://BUCKET/PREFIX` and `az://CONTAINER/PREFIX` stores on obstore (Rust's object_store; the
only module that imports it). Both share every operation (`_ObstoreStore`); they differ in the
client they build and in how the service names its errors.

Endpoint, credentials and region come from the standard AWS environment (AWS_ENDPOINT_URL_S3,
AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_REGION /
AWS_DEFAULT_REGION, default 'us-east-1'), each overridable by keyword; what the environment does not
give is looked up as botocore does (AWS_PROFILE, the config and credentials files, SSO, instance and
container metadata) when botocore is installed, so both S3 clients find the same account. A plain
`http://` endpoint is allowed. Addressing is path-style, so any S3-compatible server works.
`put_if_absent` is a conditional PUT (`If-None-Match: *`). Every PUT carries a checksum of its body,
which the server checks before the object exists: a body damaged on the way is refused (BadDigest)
and retried, and an upload cut off after its headers is never stored as an empty object. By default
`x-amz-checksum-crc64nvme` over an unsigned payload (the header itself is signed): a signed payload
needs the body's SHA-256, 1.6 ms of CPU a 2.35 MB segment against about 0.2 for the CRC.
`LAKESTREAM_S3_CHECKSUM=sha256` signs the payload and sends `x-amz-checksum-sha256` (the same
hash, so it costs nothing more), for a server that does not know CRC64NVME. GETs (whole objects
and ranges) go first to `_lean.LeanGet`, plain HTTP/1.1 on the event loop without obstore's
crossings to its threads and back, which leaves to obstore what it does not serve
(`LAKESTREAM_S3_LEAN_GET=0`: none).

Azure Blob Storage (`az://`): the account, its credentials and the endpoint come from the
environment variables obstore reads (AZURE_STORAGE_ACCOUNT_NAME, AZURE_STORAGE_ACCOUNT_KEY, a SAS
in AZURE_STORAGE_SAS_KEY, a service principal, a managed identity, AZURE_STORAGE_ENDPOINT,
AZURE_STORAGE_USE_EMULATOR), each of account, key and endpoint overridable by keyword.
`put_if_absent` is a Put Blob with `If-None-Match: *`; a Put Blob stores its blob only once the
whole body its Content-Length announces has arrived, so a cut-off upload stores nothing.

Retries are ours alone (obstore's are off), as `_s3base` describes. obstore reports an error
response as text; `_response` reads its HTTP status and error code out of it (S3 and Azure both
answer `<Error><Code>`) and `_translate` turns every obstore error into a Lakestream StoreError.
"""

from __future__ import annotations

import atexit
import os
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Self, TypeVar

import anyio
import obstore
from obstore.exceptions import (
    AlreadyExistsError,
    BaseError,
    PermissionDeniedError,
    PreconditionError,
    UnauthenticatedError,
)
from obstore.store import AzureStore as _AzureClient
from obstore.store import S3Store as _Client

if TYPE_CHECKING:
    from obstore.store import AzureConfig, ClientConfig, S3Config, S3Credential

from .._errors import StoreError
from .._tasks import task_group
from ._base import Data
from ._lean import LeanAnswer, LeanFailed, LeanGet, LeanUnavailable, botocore_keys, lean_enabled
from ._s3base import S3Base, retryable_response

__all__ = ["ObstoreAzureStore", "ObstoreS3Store", "usable"]

T = TypeVar("T")

_BATCH = 1000  # DeleteObjects limit
_DELETE_EACH = 32  # single deletes in flight when a batch delete must be done again key by key
_REQUEST_TIMEOUT = timedelta(minutes=10)  # a whole request; a stalled one is cut by `read_timeout`
_STATUS = re.compile(r"status code: (\d{3})")
_CODE = re.compile(r"<Code>([^<]*)</Code>")
_MESSAGE = re.compile(r"<Message>([^<]*)</Message>")
_TRANSPORT = re.compile(r"HTTP error|error sending request|timed out|connection", re.IGNORECASE)
_BULK = re.compile(r"Bulk delete request failed for key [^\n]{0,2048}?: ([^\n]{0,2048}) \(code: (\d{3})\)")
_ERROR_BODY = 64 * 1024  # of an error answer, the part read for its code and message
_BULK_CODES = {"The specified container does not exist.": "ContainerNotFound"}  # Azure's batch says no code


def _response(e: BaseException) -> tuple[str, int, str]:
    """(error code, HTTP status, message) of an obstore error or a lean GET's answer: ('', 0, text)
    if no response came back."""
    if isinstance(e, LeanAnswer):  # an answer to the lean GET: the body is the server's (bounded here)
        text = e.body[:_ERROR_BODY].decode("utf-8", "replace")
        code, message = _CODE.search(text), _MESSAGE.search(text)
        return code.group(1) if code else "", e.status, message.group(1) if message else f"HTTP {e.status}"
    text = str(e).split("\n\nDebug source:", 1)[0]
    if bulk := _BULK.search(text):  # one key's answer within a batch delete
        return _BULK_CODES.get(bulk.group(1), ""), int(bulk.group(2)), bulk.group(1)
    status = _STATUS.search(text)
    code = _CODE.search(text)
    message = _MESSAGE.search(text)
    return (
        code.group(1) if code else "",
        int(status.group(1)) if status else 0,
        message.group(1) if message else text.splitlines()[0] if text else type(e).__name__,
    )


def _transient(e: Exception) -> bool:
    """Worth another attempt: throttling or a 5xx response, or no response at all (refused, reset,
    timed out)."""
    if isinstance(e, LeanAnswer):
        return retryable_response(*_response(e)[:2])
    if isinstance(e, LeanFailed):
        return True
    if not isinstance(e, BaseError):  # FileNotFoundError: a 404
        return False
    code, status, message = _response(e)
    if status:
        return retryable_response(code, status)
    return _TRANSPORT.search(message) is not None


class _BotocoreCredentials:
    """obstore's credential callback over botocore's chain (profiles, SSO, metadata), which
    refreshes temporary credentials itself; obstore asks again every few minutes."""

    def __init__(self, credentials: Any) -> None:
        self.keys = botocore_keys(credentials)  # the lean GET's, over the same chain

    def __call__(self) -> S3Credential:
        key_id, secret, token = self.keys()
        return {
            "access_key_id": key_id,
            "secret_access_key": secret,
            "token": token,
            "expires_at": datetime.now(UTC) + timedelta(minutes=5),
        }


_graced = False
_started_in: int | None = None  # the process whose obstore threads run: they do not survive a fork


def usable() -> bool:
    """False in a process forked from one that used obstore: the threads obstore's calls run on
    were not forked with it, so a call would never return."""
    return _started_in is None or _started_in == os.getpid()


def _grace_at_exit() -> None:
    """Give obstore's threads a moment at exit. A thread that completes a call hands its result
    to the event loop (`call_soon_threadsafe`), then waits for the GIL; if the interpreter has begun
    to finalize by then, CPython ends the thread with pthread_exit, whose unwinding through Rust
    frames aborts the process (SIGABRT) after the program itself finished. Sleeping in an atexit
    callback, before finalization, lets such a thread take the GIL and return."""
    global _graced
    if not _graced:
        _graced = True
        atexit.register(time.sleep, 0.02)


def _botocore_session() -> Any:
    try:
        import botocore.session
    except ImportError:  # pragma: no cover - depends on the environment
        return None
    return botocore.session.get_session()


CHECKSUMS = ("crc64nvme", "sha256")


def _checksum_config() -> S3Config:
    """How PUTs prove their body (`LAKESTREAM_S3_CHECKSUM`, default crc64nvme). ValueError if unknown."""
    name = os.environ.get("LAKESTREAM_S3_CHECKSUM", "").strip().lower() or CHECKSUMS[0]
    if name == "crc64nvme":
        return {"checksum_algorithm": "crc64nvme", "unsigned_payload": True}
    if name == "sha256":
        return {"checksum_algorithm": "sha256"}
    raise ValueError(f"LAKESTREAM_S3_CHECKSUM={name!r}: expected one of {', '.join(CHECKSUMS)}")


class _ObstoreStore(S3Base):
    """Every operation of an obstore store; a service's store builds the client (`_new_client`)."""

    _client_options: ClientConfig

    def _configure(self, *, max_pool_connections: int, connect_timeout: float, read_timeout: float) -> None:
        self._client_options = {
            "connect_timeout": timedelta(seconds=connect_timeout),
            "read_timeout": timedelta(seconds=read_timeout),
            "timeout": _REQUEST_TIMEOUT,
            "pool_max_idle_per_host": str(max_pool_connections),
        }
        self._timeouts = (connect_timeout, read_timeout, max_pool_connections)
        self._opened_in = os.getpid()
        self._lean: LeanGet | None = None  # s3://: GETs without obstore's thread crossings (_lean.py)

    def _new_client(self) -> Any:
        raise NotImplementedError

    def _http_options(self) -> ClientConfig:
        """The client options, with plain `http://` allowed where the endpoint is one."""
        return {**self._client_options, "allow_http": self.endpoint_url.startswith("http://")}

    def _missing_container(self, e: Exception) -> bool:
        return _response(e)[0] in self.MISSING_CONTAINER_CODES

    # -- plumbing ------------------------------------------------------------------------------

    def _get_client(self) -> Any:
        global _started_in
        if not usable():
            if self._opened_in == os.getpid():  # az://: no other client to fall back on (s3:// has one)
                raise StoreError(
                    f"{self.url}: this process was forked from one that had used obstore, whose threads a fork "
                    "does not copy: start it by spawn instead (a DataLoader: multiprocessing_context='spawn')"
                )
            raise StoreError(
                f"{self.url}: this store was opened in the process this one was forked from, after obstore "
                "had started its threads there, which a fork does not copy: open the store in this process"
            )
        if self._client is None:
            self._client = self._new_client()
            _started_in = os.getpid()
            _grace_at_exit()
        return self._client

    def _translate(self, e: Exception, key: str | None, op: str, attempts: int, elapsed: float) -> StoreError:
        """An obstore error as a Lakestream error."""
        code, status, message = _response(e)
        if _transient(e):
            if status:
                return self._kept_failing(op, attempts, elapsed, f"{code or status}: {message}")
            return self._unreachable(attempts, elapsed, message)
        if status or isinstance(e, FileNotFoundError):
            return self._error(code, status or 404, message, key, op)
        if isinstance(e, (PermissionDeniedError, UnauthenticatedError)):
            return self._no_credentials(message)
        return StoreError(f"{self.url}: {op} failed in {self._where()}: {message}")

    async def _run(self, op: str, key: str | None, attempt: Callable[[Any], Awaitable[T]]) -> T:
        """`attempt(client)` with our retries; obstore errors leave here translated."""

        async def once() -> T:
            return await attempt(self._get_client())

        return await self._retrying(
            op,
            key,
            once,
            transient=_transient,
            client_error=(BaseError, FileNotFoundError, LeanAnswer, LeanFailed),
            translate=self._translate,
        )

    # -- the protocol ----------------------------------------------------------------------------

    async def _lean_first(self, fetch: Callable[[LeanGet], Awaitable[T]]) -> T | None:
        """The lean GET's answer; None where it does not serve the call (obstore answers it)."""
        lean = self._lean
        if lean is None or lean.resting():
            return None
        try:
            return await fetch(lean)
        except LeanUnavailable:
            return None

    async def get(self, key: str) -> bytes:
        """The whole object. Raises ObjectNotFound."""
        full = self._key(key)

        async def attempt(c: Any) -> bytes:
            if (data := await self._lean_first(lambda lean: lean.get(full))) is not None:
                return data
            result = await obstore.get_async(c, full)
            return bytes(await result.bytes_async())

        return await self._run("get", key, attempt)

    async def get_range(self, key: str, offset: int, length: int) -> bytes:
        """`length` bytes from `offset` (fewer at the end of the object), as a memoryview of the
        buffer the response was read into (no copy): pooled writable memory of the caller's own
        from the lean GET, obstore's read-only buffer else. Raises ObjectNotFound."""
        if offset < 0 or length < 0:
            raise ValueError(f"invalid range offset={offset} length={length}")
        full = self._key(key)
        if length == 0:
            return b""

        async def attempt(c: Any) -> bytes:
            try:
                if (got := await self._lean_first(lambda lean: lean.get_range(full, offset, length))) is not None:
                    return got  # type: ignore[return-value]  # a memoryview, as the protocol allows
                data = await obstore.get_range_async(c, full, start=offset, length=length)
            except (BaseError, LeanAnswer) as e:  # either client's answer to a range at or past the end
                code, status, _ = _response(e)
                if status == 416 or code == "InvalidRange" or "InvalidRangeRequest" in str(e):  # at or past the end
                    return b""
                raise
            return memoryview(data)  # type: ignore[return-value]

        return await self._run("get_range", key, attempt)

    async def put(self, key: str, data: Data) -> None:
        """Create or replace the object, whole or not at all (one request, never multipart)."""
        full = self._key(key)

        async def attempt(c: Any) -> None:
            await obstore.put_async(c, full, data, use_multipart=False)

        await self._run("put", key, attempt)

    async def put_if_absent(self, key: str, data: Data) -> bool:
        """Conditional PUT (`If-None-Match: *`). False on 412, which after a retry may mean an
        earlier attempt of this same call landed: the caller resolves that ambiguity."""
        full = self._key(key)

        async def attempt(c: Any) -> bool:
            try:
                await obstore.put_async(c, full, data, mode="create", use_multipart=False)
            except (AlreadyExistsError, PreconditionError):
                return False
            return True

        return await self._run("put_if_absent", key, attempt)

    async def list(self, prefix: str) -> list[str]:
        """Every key starting with `prefix`, sorted here (not every server lists in byte order)."""
        return sorted(await self.list_sizes(prefix))

    async def list_sizes(self, prefix: str) -> dict[str, int]:
        """Every key starting with `prefix`, with its size.

        obstore lists whole "directories" (a prefix ending at a '/'), so a prefix that ends
        within a name lists its directory and keeps the keys that match. A listing that fails
        part way is started again (keys are collected by name, so nothing is counted twice)."""
        full = self._root + prefix
        directory = full[: full.rfind("/") + 1]
        cut = len(self._root)
        keys: dict[str, int] = {}
        pages: Any = None

        async def page(c: Any) -> Sequence[Any] | None:
            nonlocal pages
            if pages is None:
                pages = obstore.list(c, directory or None, chunk_size=_BATCH)
            try:
                return await pages.__anext__()  # type: ignore[no-any-return]
            except StopAsyncIteration:
                return None
            except BaseException:
                pages = None
                raise

        while (listed := await self._run("list", None, page)) is not None:
            keys.update(
                (o["path"][cut:], int(o["size"]))
                for o in listed
                if o["path"].startswith(full) and not o["path"].endswith("/")
            )
        return keys

    async def delete(self, keys: Sequence[str]) -> None:
        """Delete the objects (DeleteObjects, 1000 a request); missing ones are ignored."""
        full = [self._key(k) for k in keys]
        for i in range(0, len(full), _BATCH):
            batch = full[i : i + _BATCH]

            async def attempt(c: Any) -> None:
                try:
                    await obstore.delete_async(c, batch)
                except FileNotFoundError as e:  # Azure: a batch names a key that was missing (the rest are gone)
                    if self._missing_container(e):
                        raise
                    await self._delete_each(c, batch)

            await self._run("delete", None, attempt)

    async def _delete_each(self, c: Any, keys: Sequence[str]) -> None:
        """Delete each key alone (a batch of one), a missing one ignored (a missing container is not)."""
        limit = anyio.Semaphore(_DELETE_EACH)

        async def one(key: str) -> None:
            async with limit:
                try:
                    await obstore.delete_async(c, key)
                except FileNotFoundError as e:
                    if self._missing_container(e):
                        raise

        async with task_group() as tg:
            for key in keys:
                tg.start_soon(one, key)

    async def aclose(self) -> None:
        """Drop the client and its connections. Idempotent."""
        self._client = None
        if self._lean is not None:
            self._lean.close()
            self._lean = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class ObstoreS3Store(_ObstoreStore):
    """An object store rooted at `s3://bucket/prefix` on obstore; keys are relative to the prefix.
    Its options are `S3Base`'s (`max_pool_connections`: the idle connections kept)."""

    def _configure(self, *, max_pool_connections: int, connect_timeout: float, read_timeout: float) -> None:
        self._checksum = _checksum_config()  # read when the store is opened, so that a bad value fails there
        self._lean_on = lean_enabled()
        super()._configure(
            max_pool_connections=max_pool_connections, connect_timeout=connect_timeout, read_timeout=read_timeout
        )

    def _new_client(self) -> Any:
        env = os.environ
        session = None
        config: S3Config = {"virtual_hosted_style_request": False, **self._checksum}
        endpoint = self._endpoint or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
        region = self._region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
        key_id, secret, token = self._keys
        if not (key_id and secret) and env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
            key_id = key_id or env["AWS_ACCESS_KEY_ID"]
            secret = secret or env["AWS_SECRET_ACCESS_KEY"]
            token = token or env.get("AWS_SESSION_TOKEN")
        provider = None
        if not (endpoint and region and key_id and secret) and (session := _botocore_session()) is not None:
            endpoint = endpoint or session.get_config_variable("endpoint_url")
            region = region or session.get_config_variable("region")
            if not (key_id and secret):
                credentials = session.get_credentials()
                if credentials is None:
                    raise self._no_credentials("none in the environment, the AWS config files or instance metadata")
                provider = _BotocoreCredentials(credentials)
        config["region"] = region or "us-east-1"
        if endpoint:  # obstore reads AWS_ENDPOINT_URL_S3 itself and prefers it to `endpoint`
            config["endpoint"] = config["aws_endpoint_url_s3"] = endpoint
            self.endpoint_url = endpoint
        else:
            self.endpoint_url = f"https://s3.{config['region']}.amazonaws.com"
        if key_id and secret:
            config["access_key_id"], config["secret_access_key"] = key_id, secret
            if token:
                config["session_token"] = token
        keys = (key_id, secret, token) if key_id and secret else provider and provider.keys
        if self._lean_on and keys and not LeanGet.proxied(self.endpoint_url):
            connect_timeout, read_timeout, pool = self._timeouts
            try:
                self._lean = LeanGet(
                    self.endpoint_url,
                    self.bucket,
                    config["region"],
                    keys,
                    connect_timeout=connect_timeout,
                    read_timeout=read_timeout,
                    pool=pool,
                )
            except ValueError:  # an endpoint with a path: obstore alone
                self._lean = None
        return _Client(
            self.bucket,
            config=config,
            client_options=self._http_options(),
            retry_config={"max_retries": 0},  # retries are ours
            credential_provider=provider,
        )


class ObstoreAzureStore(_ObstoreStore):
    """An object store rooted at `az://container/prefix` (Azure Blob Storage) on obstore.

    Options: `account_name`, `account_key` and `endpoint_url` (default from the environment
    obstore reads, as the module says; else `https://ACCOUNT.blob.core.windows.net`), and the
    connection, retry and rate options of `S3Base` (its `aws_*` and `region_name` are not used)."""

    SCHEME = "az"
    CONTAINER = "container"
    CREDENTIALS = "AZURE_STORAGE_ACCOUNT_NAME / AZURE_STORAGE_ACCOUNT_KEY, or another Azure credential"
    MISSING_CONTAINER_CODES = frozenset({"ContainerNotFound"})
    DENIED_CODES = frozenset(
        {
            "AuthenticationFailed",
            "AuthorizationFailure",
            "AuthorizationPermissionMismatch",
            "AuthorizationProtocolMismatch",
            "AuthorizationResourceTypeMismatch",
            "AuthorizationServiceMismatch",
            "AuthorizationSourceIPMismatch",
            "InsufficientAccountPermissions",
            "InvalidAuthenticationInfo",
            "AccountIsDisabled",
        }
    )

    def __init__(
        self,
        container: str,
        prefix: str = "",
        *,
        account_name: str | None = None,
        account_key: str | None = None,
        endpoint_url: str | None = None,
        **options: Any,
    ) -> None:
        env = os.environ
        self._account = account_name or env.get("AZURE_STORAGE_ACCOUNT_NAME") or env.get("AZURE_STORAGE_ACCOUNT")
        self._account_key = account_key
        self._emulator = env.get("AZURE_STORAGE_USE_EMULATOR", "").lower() in ("1", "true")
        super().__init__(container, prefix, endpoint_url=endpoint_url, **options)
        self.endpoint_url = (
            endpoint_url
            or env.get("AZURE_STORAGE_ENDPOINT")
            or env.get("AZURE_ENDPOINT")
            or (f"http://127.0.0.1:10000/{self._account or 'devstoreaccount1'}" if self._emulator else "")
            or f"https://{self._account or 'ACCOUNT'}.blob.core.windows.net"
        )

    def _new_client(self) -> Any:
        if not self._account and not self._emulator:
            raise self._no_credentials("no storage account named (AZURE_STORAGE_ACCOUNT_NAME)")
        config: AzureConfig = {}
        if self._account:
            config["account_name"] = self._account
        if self._account_key:
            config["account_key"] = self._account_key
        if self._endpoint:
            config["endpoint"] = self._endpoint
        return _AzureClient(
            self.bucket, config=config, client_options=self._http_options(), retry_config={"max_retries": 0}
        )
