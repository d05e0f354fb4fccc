"""Domain errors. Each kind maps to one gRPC status code in asyncps.net.rpc; no grpc import here."""

from __future__ import annotations


class AsyncpsError(Exception):
    """Base class of errors a server reports to its caller with a specific status code."""


class NotFoundError(AsyncpsError):
    """A named thing (variable, worker) does not exist."""


class InvalidArgumentError(AsyncpsError):
    """The request is malformed: shape, dtype, byte length, NaN/Inf, versions from the future."""


class NonFiniteGradientError(InvalidArgumentError):
    """A gradient holds NaN or Inf (INVALID_ARGUMENT, typed by asyncps.net.rpc): the worker counts the step
    as non-finite (asyncps.rules.drops.DropReason.NONFINITE) and goes on."""


class FailedPreconditionError(AsyncpsError):
    """The server is not in a state where the request can run (e.g. push before initialize)."""


class AlreadyExistsError(AsyncpsError):
    """A conflicting initialization was already accepted."""


class ResourceExhaustedError(AsyncpsError):
    """The request is larger than the configured limit."""


class UnauthenticatedError(AsyncpsError):
    """The caller did not present a valid token."""


class PermissionDeniedError(AsyncpsError):
    """The caller's role may not do this (a worker asking for a chief's operation)."""


class AbortedError(AsyncpsError):
    """The operation was cancelled because the server is stopping."""


class UnavailableError(AsyncpsError):
    """Not now, and nothing changed: the caller retries (SSP holds a worker that runs ahead)."""


class InternalError(AsyncpsError):
    """The server failed unexpectedly (its log has the detail)."""


class PathNotVisibleError(FailedPreconditionError):
    """The shard cannot reach this client's data path (e.g. its shared memory from another host):
    the client falls back to the next path (FAILED_PRECONDITION, typed by asyncps.net.rpc)."""


class AttachAgainError(FailedPreconditionError):
    """The shard no longer holds this client's data-path attachment (a restart, a replacement): the
    client attaches a fresh one (FAILED_PRECONDITION, typed by asyncps.net.rpc)."""
