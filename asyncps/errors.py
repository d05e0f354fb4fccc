"""Domain errors. Each kind maps to one gRPC status code in asyncps.net.rpc; no grpc import here.

They are the one error model on both sides of the transport seam: a server raises them and its
adapter turns them into status codes; every client path (gRPC, TCP, shared memory, the chief's client)
turns what it receives back into them at its own edge, so the code above the seam catches only these.
"""

from __future__ import annotations


class AsyncpsError(Exception):
    """Base class of errors a server reports to its caller with a specific status code.

    `detail` is the message (str(error) too); `code` the name of the status code the error arrived
    with (e.g. "NOT_FOUND"; "" when it was raised on this side), so a log or a test still says what
    the peer answered.
    """

    def __init__(self, detail: str = "", code: str = "") -> None:
        super().__init__(detail)
        self.detail = detail
        self.code = code


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
    """The server failed unexpectedly (its log has the detail), or a peer answered with a status code
    that names no domain error (`code` says which)."""


class DeadlineExceededError(AsyncpsError):
    """One attempt of a call ran past its deadline (its request or reply may have been lost)."""


class UnimplementedError(AsyncpsError):
    """The peer has no such call (an older server)."""


class Unreachable(UnavailableError):
    """A peer stayed unavailable until the caller's overall deadline, or until the caller stopped:
    the verdict of the retries (asyncps.net.retry), never retried itself."""


class PathNotVisibleError(FailedPreconditionError):
    """The shard cannot reach this client's data path (e.g. its shared memory from another host):
    the client falls back to the next path (FAILED_PRECONDITION, typed by asyncps.net.rpc)."""


class AttachAgainError(FailedPreconditionError):
    """The shard no longer holds this client's data-path attachment (a restart, a replacement): the
    client attaches a fresh one (FAILED_PRECONDITION, typed by asyncps.net.rpc)."""
