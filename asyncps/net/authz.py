"""Per-role authorization: which identity may call which RPC, and who a caller is.

Two roles: the chief (which owns a shard's lifecycle: Initialize, Restore, Pause, Snapshot,
SetLiveWorkers, Shutdown) and the worker (push, pull, statistics, the coordinator's calls). The
chief may also do everything a worker may. A caller's roles come from its token (the workers'
token or the chief's token) and, under mutual TLS, from its certificate's names (common name or
a DNS/IP subject alternative name listed as a chief identity); with both, it holds only the roles
both grant. A call no role of the caller allows fails with PERMISSION_DENIED before it reaches
the service, so a denied call never changes a shard. Methods missing from METHOD_ROLES are
denied: a new RPC has to be given its roles here.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from asyncps.net.handlers import Handler, behavior, refusing, with_behavior
from asyncps.wire.proto import SHARD_SERVICE

log = logging.getLogger(__name__)

CHIEF = "chief"
WORKER = "worker"
ALL_ROLES = frozenset({CHIEF, WORKER})
COORDINATOR_SERVICE = "asyncps.pb.Coordinator"
HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"
DEFAULT_CHIEF_IDENTITY = "asyncps-chief"  # the common name of devcerts' chief certificate
AUTH_METADATA_KEY = "authorization"
BEARER_SCHEME = "Bearer"

_CHIEF_ONLY = frozenset({CHIEF})
_ANY_ROLE = ALL_ROLES
# Who may call what. Keys are full method paths; a role not listed gets PERMISSION_DENIED.
METHOD_ROLES: Mapping[str, frozenset[str]] = {
    **{f"/{SHARD_SERVICE}/{name}": _CHIEF_ONLY
       for name in ("Initialize", "Restore", "Pause", "Snapshot", "SetLiveWorkers", "Shutdown", "SetBackup",
                    "Promote")},
    **{f"/{SHARD_SERVICE}/{name}": _ANY_ROLE
       for name in ("Pull", "Push", "PushPull", "GetStats", "AttachShm", "ShmPushPull",
                     "DataPort")},
    **{f"/{COORDINATOR_SERVICE}/{name}": _ANY_ROLE
       for name in ("Register", "Heartbeat", "Report", "GetTask", "GetStatus", "WaitStart")},
}

if TYPE_CHECKING:
    _ServerInterceptor = grpc.ServerInterceptor[Any, Any]
else:  # the runtime class is not generic
    _ServerInterceptor = grpc.ServerInterceptor


def describe_roles(roles: Iterable[str]) -> str:
    """"chief", "worker", "chief+worker" or "no role"."""
    return "+".join(sorted(roles)) or "no role"


def _method_name(method: str) -> str:
    return method.rsplit("/", 1)[-1]


class TokenRoles:
    """Maps a presented bearer token to roles (constant-time comparisons; tokens never logged)."""

    def __init__(self, worker_token: str, chief_token: str = "", shared: bool = False) -> None:
        if not worker_token:
            raise ValueError("token authorization needs the workers' token")
        if chief_token and hmac.compare_digest(chief_token, worker_token):
            raise ValueError("the chief's token must differ from the workers' token "
                             "(one token for every role: --shared-token)")
        if not chief_token and not shared:
            raise ValueError("a server with a token needs the chief's token too (--chief-token-file), "
                             "or --shared-token to let the one token act as every role")
        self._grants: list[tuple[bytes, frozenset[str]]] = [
            (worker_token.encode("ascii"), ALL_ROLES if shared else frozenset({WORKER}))]
        if chief_token:
            self._grants.insert(0, (chief_token.encode("ascii"), ALL_ROLES))

    def __repr__(self) -> str:
        return f"TokenRoles({len(self._grants)} tokens)"

    def roles(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> frozenset[str] | str:
        """The roles of the token in metadata, or why there are none ("missing/invalid token")."""
        values = [value for key, value in metadata or () if key == AUTH_METADATA_KEY]
        if not values:
            return f"missing token: send metadata '{AUTH_METADATA_KEY}: {BEARER_SCHEME} <token>'"
        if len(values) > 1 or not isinstance(values[0], str):
            return "invalid token"
        scheme, _, presented = values[0].partition(" ")
        if scheme.lower() != BEARER_SCHEME.lower():
            return "invalid token"
        given = presented.strip().encode("utf-8", "replace")
        granted: frozenset[str] | None = None
        for token, roles in self._grants:  # every comparison runs: no timing hint of which matched
            if hmac.compare_digest(given, token) and granted is None:
                granted = roles
        return "invalid token" if granted is None else granted


def certificate_names(auth_context: Mapping[str, Any]) -> set[str]:
    """The common name and subject alternative names of a peer's verified certificate.

    (grpc's stubs type the context's values as bytes; at run time each is a list of bytes.)
    """
    names: set[str] = set()
    for key in ("x509_common_name", "x509_subject_alternative_name"):
        names.update(value.decode("utf-8", "replace") for value in auth_context.get(key, ()))
    return names


def certificate_roles(auth_context: Mapping[str, Any], chief_names: frozenset[str]) -> frozenset[str]:
    """Chief and worker for a certificate naming a chief identity; worker for any other."""
    names = certificate_names(auth_context)
    if not names:
        return frozenset()  # no verified client certificate
    return ALL_ROLES if names & chief_names else frozenset({WORKER})


class Authorizer(_ServerInterceptor):
    """Authenticates every call (token, certificate) and lets through only the roles METHOD_ROLES allows.

    tokens: None for no token check. chief_names: the certificate identities of the chief under
    mTLS, None when the server does not check certificates. Health calls pass unchecked, so that
    probes need no secret; UNAUTHENTICATED for a bad token, PERMISSION_DENIED for a wrong role.
    """

    def __init__(self, tokens: TokenRoles | None, chief_names: Iterable[str] | None = None,
                 exempt_prefixes: Sequence[str] = (HEALTH_METHOD_PREFIX,)) -> None:
        self._tokens = tokens
        self._chief_names = None if chief_names is None else frozenset(chief_names)
        self._exempt = tuple(exempt_prefixes)

    def __repr__(self) -> str:
        return f"Authorizer(tokens={self._tokens!r}, chief_names={self._chief_names!r})"

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Handler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        """Refuse unauthenticated or unauthorized calls; pass the rest on, checked."""
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(self._exempt):
            return handler  # an unknown method stays UNIMPLEMENTED
        roles = ALL_ROLES
        if self._tokens is not None:
            found = self._tokens.roles(handler_call_details.invocation_metadata)
            if isinstance(found, str):
                log.warning("rejected %s: %s", method, found)
                return refusing(handler, grpc.StatusCode.UNAUTHENTICATED, found)
            roles = found
        allowed = METHOD_ROLES.get(method, frozenset())
        if not roles & allowed:
            return refusing(handler, grpc.StatusCode.PERMISSION_DENIED, self._denial(method, roles, allowed, "token"))
        if self._chief_names is None:
            return handler
        return with_behavior(handler, self._checking_certificate(behavior(handler), method, roles, allowed))

    def _denial(self, method: str, roles: frozenset[str], allowed: frozenset[str], source: str) -> str:
        message = (f"{_method_name(method)} needs the {describe_roles(allowed) if allowed else 'no'} role"
                   f"{'' if allowed else ' (not in the authorization table)'}; "
                   f"this caller's {source} grants {describe_roles(roles)}")
        log.warning("denied %s: %s", method, message)
        return message

    def _checking_certificate(self, inner: Callable[[Any, grpc.ServicerContext], Any], method: str,
                              token_roles: frozenset[str], allowed: frozenset[str]
                              ) -> Callable[[Any, grpc.ServicerContext], Any]:
        """The behaviour with the peer certificate's roles checked first (they need the context)."""
        assert self._chief_names is not None
        chief_names = self._chief_names

        def checked(request: Any, context: grpc.ServicerContext) -> Any:
            roles = token_roles & certificate_roles(context.auth_context(), chief_names)
            if not roles & allowed:
                context.abort(grpc.StatusCode.PERMISSION_DENIED,
                              self._denial(method, roles, allowed, "certificate (and token)"))
            return inner(request, context)

        return checked
