"""Authentication and transport security: per-role bearer tokens, TLS and mutual TLS.

A server built with ``create_server(..., interceptors=security.server_interceptors(),
credentials=security.server_credentials())`` rejects every RPC without
``authorization: Bearer <token>`` (the standard health service stays open for probes) and lets
each role call only its own methods (asyncps.net.authz);
``secure_channel(address, security)`` opens the matching client channel. Empty settings mean off:
plaintext and unauthenticated, which is why the roles bind loopback (LOOPBACK_HOST) unless told
otherwise, and say so (`exposure_warning`) when told to listen further without a token or mTLS.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import ssl
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import grpc

from asyncps.net import health
from asyncps.net.authz import DEFAULT_CHIEF_IDENTITY, Authorizer, TokenRoles
from asyncps.net.rpc import MAX_MESSAGE_BYTES, channel_options

log = logging.getLogger(__name__)

TOKEN_ENV = "ASYNCPS_TOKEN"
CHIEF_TOKEN_ENV = "ASYNCPS_CHIEF_TOKEN"
AUTH_METADATA_KEY = "authorization"
BEARER_SCHEME = "Bearer"
HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"
LOOPBACK_HOST = "127.0.0.1"  # where the roles bind unless --host (ASYNCPS_HOST) says otherwise
MISSING_TOKEN = "missing token"
INVALID_TOKEN = "invalid token"

if TYPE_CHECKING:
    _ServerInterceptor = grpc.ServerInterceptor[Any, Any]
    _UnaryUnaryInterceptor = grpc.UnaryUnaryClientInterceptor[Any, Any]
    _UnaryStreamInterceptor = grpc.UnaryStreamClientInterceptor[Any, Any]
    _StreamUnaryInterceptor = grpc.StreamUnaryClientInterceptor[Any, Any]
    _StreamStreamInterceptor = grpc.StreamStreamClientInterceptor[Any, Any]
    _Handler = grpc.RpcMethodHandler[Any, Any]
else:  # the runtime classes are not generic
    _ServerInterceptor = grpc.ServerInterceptor
    _UnaryUnaryInterceptor = grpc.UnaryUnaryClientInterceptor
    _UnaryStreamInterceptor = grpc.UnaryStreamClientInterceptor
    _StreamUnaryInterceptor = grpc.StreamUnaryClientInterceptor
    _StreamStreamInterceptor = grpc.StreamStreamClientInterceptor
    _Handler = grpc.RpcMethodHandler


# -- the token ---------------------------------------------------------------------------------
def check_token(token: str) -> None:
    """Raise ValueError unless token can travel as gRPC metadata (printable ASCII, no spaces).

    The message never contains the token itself.
    """
    if any(not ("!" <= ch <= "~") for ch in token):
        raise ValueError(f"the token must be printable ASCII without spaces ({len(token)} characters given)")


def load_token(token_file: str | os.PathLike[str] = "", environ: Mapping[str, str] | None = None,
               env_var: str = TOKEN_ENV) -> str:
    """A token: from token_file when given, else $env_var (ASYNCPS_TOKEN), else "" (no token auth).

    Surrounding whitespace (a trailing newline) is stripped; a named file that is missing or
    empty is a ValueError, so a typo never silently turns authentication off.
    """
    if token_file:
        path = Path(token_file)
        try:
            token = path.read_text(encoding="ascii").strip()
        except FileNotFoundError:
            raise ValueError(f"token file not found: {path}") from None
        except UnicodeDecodeError:
            raise ValueError(f"token file {path} is not ASCII text") from None
        except OSError as exc:
            raise ValueError(f"cannot read token file {path}: {exc.strerror}") from None
        if not token:
            raise ValueError(f"token file {path} is empty")
    else:
        token = (os.environ if environ is None else environ).get(env_var, "").strip()
    check_token(token)
    return token


# -- server side -------------------------------------------------------------------------------
def is_loopback(host: str) -> bool:
    """True when a server bound to host is reachable from this machine only (127.0.0.0/8, ::1, localhost).

    Any other name counts as reachable from elsewhere: the check never resolves names.
    """
    name = host.strip().strip("[]")
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def check_host(host: str) -> None:
    """ValueError for an empty --host (an ASYNCPS_HOST set to nothing), which would bind every interface."""
    if not host.strip():
        raise ValueError(f"--host is empty (ASYNCPS_HOST set to nothing?): name an interface, {LOOPBACK_HOST} "
                         "for this machine only or 0.0.0.0 for every one")


def exposure_warning(what: str, address: str, security: SecurityConfig) -> str | None:
    """The start-up warning for a server `what` bound to address (HOST:PORT) that anyone who reaches
    it may call: not loopback, no token and no client certificates. None when it is not."""
    host = address.rpartition(":")[0] if ":" in address else address
    if is_loopback(host) or security.token or security.mtls:
        return None
    return (f"{what} listens on {address} without a token or mTLS: anyone who can reach it may call every "
            f"RPC, the chief's included. Set --token-file and --chief-token-file (env {TOKEN_ENV} / "
            f"{CHIEF_TOKEN_ENV}), or mTLS (--tls-cert, --tls-key, --tls-ca), or bind --host {LOOPBACK_HOST}")


def _rejecting_handler(handler: _Handler, message: str) -> _Handler:
    """A handler of the same streaming kind as handler that fails with UNAUTHENTICATED.

    It has no request deserializer: an unauthenticated request is never parsed.
    """

    def reject(request_or_iterator: Any, context: grpc.ServicerContext) -> NoReturn:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kinds: dict[tuple[bool, bool], Callable[..., _Handler]] = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(bool(handler.request_streaming), bool(handler.response_streaming))]
    return make(reject, request_deserializer=None, response_serializer=handler.response_serializer)


class TokenAuthInterceptor(_ServerInterceptor):
    """Fails every RPC without metadata ``authorization: Bearer <token>`` with UNAUTHENTICATED.

    Methods under exempt_prefixes (the standard health service by default) pass without a token
    so that liveness probes need no secret. Tokens are compared in constant time and never logged.
    """

    def __init__(self, token: str, exempt_prefixes: Sequence[str] = (HEALTH_METHOD_PREFIX,)) -> None:
        if not token:
            raise ValueError("TokenAuthInterceptor needs a non-empty token")
        check_token(token)
        self._token = token.encode("ascii")
        self._exempt = tuple(exempt_prefixes)

    def __repr__(self) -> str:
        return f"TokenAuthInterceptor(exempt_prefixes={self._exempt!r})"

    def problem(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
        """None when metadata carries the right token, else the reason: missing or invalid token."""
        values = [value for key, value in metadata or () if key == AUTH_METADATA_KEY]
        if not values:
            return MISSING_TOKEN
        if len(values) > 1 or not isinstance(values[0], str):
            return INVALID_TOKEN
        scheme, _, presented = values[0].partition(" ")
        if scheme.lower() != BEARER_SCHEME.lower():
            return INVALID_TOKEN
        # bytes, not str: compare_digest refuses non-ASCII str, and a client may send anything
        if not hmac.compare_digest(presented.strip().encode("utf-8", "replace"), self._token):
            return INVALID_TOKEN
        return None

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], _Handler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> _Handler | None:
        """Pass authenticated and exempt calls on; answer the rest with UNAUTHENTICATED."""
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(self._exempt):
            return handler  # an unknown method stays UNIMPLEMENTED
        problem = self.problem(handler_call_details.invocation_metadata)
        if problem is None:
            return handler
        log.warning("rejected %s: %s", method, problem)
        if problem == MISSING_TOKEN:
            problem = f"{MISSING_TOKEN}: send metadata '{AUTH_METADATA_KEY}: {BEARER_SCHEME} <token>'"
        return _rejecting_handler(handler, problem)


# -- client side -------------------------------------------------------------------------------
@dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):
    """The call details grpc passes along, with our metadata added."""

    method: str
    timeout: float | None
    metadata: tuple[tuple[str, str | bytes], ...] | None
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: grpc.Compression | None


class TokenClientInterceptor(
    _UnaryUnaryInterceptor, _UnaryStreamInterceptor, _StreamUnaryInterceptor, _StreamStreamInterceptor
):
    """Adds ``authorization: Bearer <token>`` to every call of a channel, plaintext or TLS.

    (grpc's own call credentials would do the same but refuse plaintext channels.) A call that
    already sets its own authorization metadata keeps it.
    """

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("TokenClientInterceptor needs a non-empty token")
        check_token(token)
        self._entry = (AUTH_METADATA_KEY, f"{BEARER_SCHEME} {token}")

    def __repr__(self) -> str:
        return "TokenClientInterceptor()"

    def _with_token(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = tuple(details.metadata or ())
        if any(key == AUTH_METADATA_KEY for key, _ in metadata):
            return details
        return _CallDetails(
            method=details.method,
            timeout=details.timeout,
            metadata=(*metadata, self._entry),
            credentials=details.credentials,
            wait_for_ready=getattr(details, "wait_for_ready", None),
            compression=getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation: Any, client_call_details: grpc.ClientCallDetails,
                              request: Any) -> Any:
        """Unary request, unary response."""
        return continuation(self._with_token(client_call_details), request)

    def intercept_unary_stream(self, continuation: Any, client_call_details: grpc.ClientCallDetails,
                               request: Any) -> Any:
        """Unary request, streamed response."""
        return continuation(self._with_token(client_call_details), request)

    def intercept_stream_unary(self, continuation: Any, client_call_details: grpc.ClientCallDetails,
                               request_iterator: Any) -> Any:
        """Streamed request, unary response."""
        return continuation(self._with_token(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation: Any, client_call_details: grpc.ClientCallDetails,
                                request_iterator: Any) -> Any:
        """Streamed request, streamed response."""
        return continuation(self._with_token(client_call_details), request_iterator)


def with_token(channel: grpc.Channel, token: str) -> grpc.Channel:
    """Wrap channel so that every call carries the bearer token."""
    return grpc.intercept_channel(channel, TokenClientInterceptor(token))


# -- configuration -----------------------------------------------------------------------------
def _check_pem(flag: str, path: str, kind: str) -> None:
    """One-line ValueError unless path is a readable PEM file holding `kind` (CERTIFICATE or PRIVATE KEY)."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{flag}: no such file: {path}")
    try:
        text = file.read_text(encoding="ascii", errors="replace")
    except OSError as exc:
        raise ValueError(f"{flag}: cannot read {path}: {exc.strerror}") from None
    if f"{kind}-----" not in text:
        raise ValueError(f"{flag}: {path} is not a PEM {kind.lower()}")
    if "ENCRYPTED" in text:
        raise ValueError(f"{flag}: {path} is encrypted; gRPC needs an unencrypted key")


def _read(path: str) -> bytes | None:
    return Path(path).read_bytes() if path else None


@dataclass(frozen=True)
class SecurityConfig:
    """How a process authenticates and encrypts its RPCs; every empty field means off.

    As a server: tls_cert + tls_key serve TLS; tls_ca in addition requires each client to present
    a certificate signed by it (mTLS) unless require_client_cert is False; a token makes every
    RPC but the health service need ``authorization: Bearer <token>``. Roles (asyncps.net.authz):
    token is the workers' token and chief_token the chief's; shared_token lets the one token
    act as every role (compatibility, explicit only); under mTLS a client certificate naming one
    of chief_identities is the chief's, any other verified one a worker's.
    As a client: any TLS file turns TLS on; the server is verified against tls_ca (the system
    roots without it); tls_cert + tls_key are presented as the client certificate;
    server_name_override replaces the host name checked against the server's certificate;
    the chief's token when set, else the token, is sent on every call.
    File paths are read when credentials are built, so a restart picks up renewed certificates.
    """

    token: str = field(default="", repr=False)
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    server_name_override: str = ""
    require_client_cert: bool = True
    chief_token: str = field(default="", repr=False)
    shared_token: bool = False
    chief_identities: tuple[str, ...] = (DEFAULT_CHIEF_IDENTITY,)

    def __post_init__(self) -> None:
        check_token(self.token)
        check_token(self.chief_token)
        if self.chief_token and not self.token:
            raise ValueError("--chief-token-file needs --token-file (the workers' token) as well")
        if self.shared_token and not self.token:
            raise ValueError("--shared-token needs a token (--token-file or ASYNCPS_TOKEN)")
        if self.shared_token and self.chief_token:
            raise ValueError("--shared-token and --chief-token-file exclude each other: "
                             "one token for every role, or one per role")
        if not all(self.chief_identities):
            raise ValueError("--chief-identity: empty certificate name")
        if bool(self.tls_cert) != bool(self.tls_key):
            given, missing = ("--tls-cert", "--tls-key") if self.tls_cert else ("--tls-key", "--tls-cert")
            raise ValueError(f"{given} needs {missing}: a certificate and its private key go together")
        for flag, path, kind in (("--tls-cert", self.tls_cert, "CERTIFICATE"),
                                 ("--tls-key", self.tls_key, "PRIVATE KEY"),
                                 ("--tls-ca", self.tls_ca, "CERTIFICATE")):
            if path:
                _check_pem(flag, path, kind)
        if self.server_name_override and not self.tls:
            raise ValueError("a server name override needs TLS (--tls-ca)")

    @classmethod
    def from_flags(cls, token_file: str = "", tls_cert: str = "", tls_key: str = "", tls_ca: str = "",
                   server_name_override: str = "", require_client_cert: bool = True,
                   environ: Mapping[str, str] | None = None, chief_token_file: str = "",
                   shared_token: bool = False, chief_identities: Sequence[str] = (DEFAULT_CHIEF_IDENTITY,),
                   ) -> SecurityConfig:
        """Build from command-line values: the token from token_file, else $ASYNCPS_TOKEN; the
        chief's from chief_token_file, else $ASYNCPS_CHIEF_TOKEN."""
        return cls(token=load_token(token_file, environ), tls_cert=tls_cert, tls_key=tls_key,
                   tls_ca=tls_ca, server_name_override=server_name_override,
                   require_client_cert=require_client_cert,
                   chief_token=load_token(chief_token_file, environ, CHIEF_TOKEN_ENV),
                   shared_token=shared_token, chief_identities=tuple(chief_identities))

    @property
    def tls(self) -> bool:
        """Whether TLS is on (any certificate file given)."""
        return bool(self.tls_cert or self.tls_ca)

    @property
    def mtls(self) -> bool:
        """Whether a server with this configuration requires client certificates."""
        return bool(self.tls_cert and self.tls_ca and self.require_client_cert)

    def describe(self) -> str:
        """One line for start-up logs, without secrets: e.g. "mTLS, token auth"."""
        transport = "mTLS" if self.mtls else "TLS" if self.tls else "plaintext"
        tokens = ("shared token" if self.shared_token else "per-role tokens" if self.chief_token
                  else "token")
        return f"{transport}, {tokens + ' auth' if self.token else 'no token auth'}"

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """Credentials for create_server: None for plaintext; TLS with tls_cert + tls_key."""
        if not self.tls_cert:
            if self.tls_ca:
                raise ValueError("a TLS server needs --tls-cert and --tls-key; only --tls-ca was given")
            return None
        pair = (Path(self.tls_key).read_bytes(), Path(self.tls_cert).read_bytes())
        return grpc.ssl_server_credentials([pair], root_certificates=_read(self.tls_ca),
                                           require_client_auth=self.mtls)

    def ssl_server_context(self) -> ssl.SSLContext | None:
        """The same server TLS for a listener outside gRPC (the TCP data port, the metrics endpoint):
        None for plaintext; with tls_ca and require_client_cert, client certificates are required."""
        if not self.tls_cert:
            return None
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.tls_cert, self.tls_key)
        if self.mtls:
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_verify_locations(self.tls_ca)
        return context

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """Credentials for a client channel: None for plaintext, else TLS (+ client certificate)."""
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(root_certificates=_read(self.tls_ca),
                                            private_key=_read(self.tls_key),
                                            certificate_chain=_read(self.tls_cert))

    def channel_options(self) -> list[tuple[str, Any]]:
        """Channel arguments security adds (the server name override for development certificates)."""
        if self.server_name_override:
            return [("grpc.ssl_target_name_override", self.server_name_override)]
        return []

    @property
    def client_token(self) -> str:
        """The token this process sends: the chief's when it has one, else the workers'."""
        return self.chief_token or self.token

    def check_server(self) -> None:
        """ValueError unless a server can tell the chief from a worker with these settings."""
        if self.token:
            TokenRoles(self.token, self.chief_token, self.shared_token)

    def server_interceptors(self) -> list[_ServerInterceptor]:
        """Interceptors for create_server: authentication and per-role authorization (asyncps.net.authz)
        when a token is set or client certificates are required."""
        tokens = TokenRoles(self.token, self.chief_token, self.shared_token) if self.token else None
        if tokens is None and not self.mtls:
            return []
        return [Authorizer(tokens, self.chief_identities if self.mtls else None)]


def secure_channel(address: str, security: SecurityConfig,
                   max_message_bytes: int = MAX_MESSAGE_BYTES) -> grpc.Channel:
    """A client channel to address as security says: plaintext, TLS or mTLS, plus the token."""
    options = channel_options(max_message_bytes) + security.channel_options()
    credentials = security.channel_credentials()
    if credentials is None:
        channel = grpc.insecure_channel(address, options=options)
    else:
        channel = grpc.secure_channel(address, credentials, options=options)
    return with_token(channel, security.client_token) if security.client_token else channel


def check_health(address: str, security: SecurityConfig, timeout_s: float = 3.0) -> bool:
    """True when the server at address answers SERVING on the health service over this transport."""
    with secure_channel(address, security) as channel:
        try:
            return health.check(channel, health.OVERALL, timeout_s) == health.SERVING
        except grpc.RpcError:
            return False
