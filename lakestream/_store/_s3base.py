"""What the remote stores share (`s3://` on either client, `az://` on obstore): the URL, key
checks, our retries and the one translation of an error response (its code and HTTP status) into a
Lakestream error. No client is imported here. A store of another service than S3 names its scheme,
what it calls a bucket, where its credentials come from and its error codes in class attributes.

Retries are ours alone (the clients' are off): throttling, 5xx, connection errors and timeouts are
retried by `_retry.retry` with jittered exponential backoff (`S3_BACKOFF`) within `max_attempts`
and `retry_timeout` seconds, then raise StoreUnavailable.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, Self, TypeVar

import anyio

from .._errors import AccessDenied, BucketNotFound, ObjectNotFound, StoreError, StoreUnavailable
from .._retry import Backoff, RandomSource, retry
from ._budget import RequestBudget, budget_for

__all__ = ["DENIED_CODES", "RETRY_CODES", "S3_BACKOFF", "S3Base", "retryable_response"]

T = TypeVar("T")

RETRY_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "TooManyRequests",
        "RequestLimitExceeded",
        "RequestThrottled",
        "ServiceUnavailable",
        "InternalError",
        "RequestTimeout",
        "ConditionalRequestConflict",  # 409: a concurrent conditional write on the key is in flight
        "OperationAborted",
    }
)
DENIED_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "InvalidToken",
        "ExpiredToken",
        "TokenRefreshRequired",
        "AllAccessDisabled",
        "AccountProblem",
        "InvalidSecurity",
    }
)
LOG_AREA = "_lakestream/"  # the prefix every process reads and writes: the budget's
S3_BACKOFF = Backoff(first=0.1, cap=2.0, jitter=0.5)  # waits of 0.05–0.1 s, doubling to 1–2 s


def retryable_response(code: str, status: int) -> bool:
    """An S3 error response worth another attempt: throttling, a conflict in flight, a 5xx."""
    return code in RETRY_CODES or status == 429 or (status >= 500 and status != 501)


class S3Base:
    """The parts of an `s3://bucket/prefix` store that do not depend on the client (nor, but for
    the class attributes below and the options `_configure` reads, on the service).

    Keyword options, the same for both clients: `endpoint_url`, `aws_access_key_id`,
    `aws_secret_access_key`, `aws_session_token`, `region_name` (default from the environment, else
    'us-east-1'), `max_pool_connections` (64), `connect_timeout` (5 s), `read_timeout` (60 s),
    `max_attempts` (50) and `retry_timeout` (10 s) for our retries: a call gives up when either runs
    out, so with the defaults it is the time (a throttled store is retried for the full 10 s).
    `get_rate` (5,500) and `put_rate` (3,500): this process's requests per second on the stream's
    `_lakestream/` prefix (and its LISTs and DELETEs), halved on throttling and given back slowly
    (`_budget.RequestBudget`; one budget per process and stream, `budget` to give one's own).
    `clock`, `sleep` and `rng` time and space those retries (tests inject fakes). The client is
    created on first use; `aclose()` releases it (a later call opens a new one). A client's store
    turns these options into its own configuration in `_configure`.
    """

    SCHEME = "s3"
    CONTAINER = "bucket"  # what the service calls the namespace the URL names first
    CREDENTIALS = "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"  # where a user sets them
    MISSING_CONTAINER_CODES = frozenset({"NoSuchBucket"})
    DENIED_CODES = DENIED_CODES

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        aws_access_key_id: str | None = None,
        aws_secret_access_key: str | None = None,
        aws_session_token: str | None = None,
        region_name: str | None = None,
        max_pool_connections: int = 64,
        connect_timeout: float = 5.0,
        read_timeout: float = 60.0,
        max_attempts: int = 50,
        retry_timeout: float = 10.0,
        get_rate: float = 5500.0,
        put_rate: float = 3500.0,
        budget: RequestBudget | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
        rng: RandomSource | None = None,
    ) -> None:
        if not bucket or "/" in bucket:
            raise ValueError(f"invalid {self.SCHEME}:// {self.CONTAINER} name {bucket!r}")
        prefix = prefix.strip("/")
        self.bucket = bucket
        self.prefix = prefix
        self.url = f"{self.SCHEME}://{bucket}/{prefix}" if prefix else f"{self.SCHEME}://{bucket}"
        self.requests = 0  # requests sent, retries included (for cost accounting)
        self._root = prefix + "/" if prefix else ""
        self.max_attempts = max(1, max_attempts)
        self.retry_timeout = retry_timeout
        self.clock, self.sleep, self.rng = clock, sleep, rng
        self.budget = budget or budget_for(self.url, get_rate, put_rate)
        # A guess for messages until the client resolves it (both clients read the same variables).
        self.endpoint_url: str = (
            endpoint_url
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
            or "the default AWS endpoint"
        )
        self._endpoint = endpoint_url
        self._keys = (aws_access_key_id, aws_secret_access_key, aws_session_token)
        self._region = region_name
        self._client: Any = None
        self._configure(
            max_pool_connections=max_pool_connections, connect_timeout=connect_timeout, read_timeout=read_timeout
        )

    def _configure(self, *, max_pool_connections: int, connect_timeout: float, read_timeout: float) -> None:
        """The client's configuration from the connection options (each client's store has its own)."""
        raise NotImplementedError

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Self:
        """A store for `s3://BUCKET[/PREFIX]` (`SCHEME://...`)."""
        scheme = f"{cls.SCHEME}://"
        if not url.startswith(scheme):
            raise ValueError(f"not an {scheme} URL: {url!r}")
        bucket, _, prefix = url[len(scheme) :].partition("/")
        return cls(bucket, prefix, **options)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r}, endpoint={self.endpoint_url!r})"

    def _key(self, key: str) -> str:
        if not key or any(p in ("", ".", "..") for p in key.split("/")):
            raise ValueError(f"{self.url}: invalid object key {key!r}")
        return self._root + key

    def _where(self) -> str:
        return f"{self.CONTAINER} {self.bucket!r} at {self.endpoint_url}"

    def _error(self, code: str, status: int, message: str, key: str | None, op: str) -> StoreError:
        """The one translation of an error response into a Lakestream error."""
        where = self._where()
        if code in self.MISSING_CONTAINER_CODES:
            return BucketNotFound(f"{self.url}: {where} does not exist")
        if key is not None and (code in ("NoSuchKey", "NotFound") or status == 404):
            return ObjectNotFound(f"{self.url}: no object {key!r} (key {self._root + key!r} in {where})")
        if code in self.DENIED_CODES or status == 403:
            return AccessDenied(
                f"{self.url}: {where} denied {op} ({code or status}: {message}); check the credentials "
                f"({self.CREDENTIALS}) and their permissions"
            )
        target = f" {key!r}" if key is not None else ""
        return StoreError(f"{self.url}: {op}{target} failed in {where}: {code or status}: {message}")

    def _kept_failing(self, op: str, attempts: int, elapsed: float, what: object) -> StoreUnavailable:
        return StoreUnavailable(
            f"{self.url}: {op} kept failing in {self._where()} ({attempts} attempts in {elapsed:.1f}s): {what}",
            retried=True,
        )

    def _no_credentials(self, what: object) -> AccessDenied:
        return AccessDenied(f"{self.url}: no usable credentials for {self._where()}: {what}; set {self.CREDENTIALS}")

    def _unreachable(self, attempts: int, elapsed: float, what: object) -> StoreUnavailable:
        return StoreUnavailable(
            f"{self.url}: endpoint {self.endpoint_url} unreachable for {self.CONTAINER} {self.bucket!r} "
            f"({attempts} attempts in {elapsed:.1f}s): {what}",
            retried=True,
        )

    async def _retrying(
        self,
        op: str,
        key: str | None,
        once: Callable[[], Awaitable[T]],
        *,
        transient: Callable[[Exception], bool],
        client_error: type[Exception] | tuple[type[Exception], ...],
        translate: Callable[[Exception, str | None, str, int, float], StoreError],
    ) -> T:
        """`once()` with our retries; the client's errors leave here translated by `translate`."""
        start = self.clock()
        n = 0

        budgeted = key is None or key.startswith(LOG_AREA)

        async def counted() -> T:
            nonlocal n
            n += 1
            if budgeted:
                await self.budget.acquire(op)
            self.requests += 1
            try:
                return await once()
            except Exception as e:
                if budgeted and transient(e):
                    self.budget.throttled(op)  # slow down rather than retry into a throttled prefix
                raise

        try:
            return await retry(
                counted,
                attempts=self.max_attempts,
                timeout=self.retry_timeout,
                backoff=S3_BACKOFF,
                transient=transient,
                clock=self.clock,
                sleep=self.sleep,
                rng=self.rng,
            )
        except client_error as e:
            raise translate(e, key, op, n, self.clock() - start) from e
