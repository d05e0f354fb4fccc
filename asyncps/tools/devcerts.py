"""Development certificates: a throwaway CA, a server and a client certificate, made with the
`cryptography` library (no openssl binary needed).

For trying TLS/mTLS locally and in the compose file, never for production. Run it as

    asyncps devcerts DIR [--name ps-0 --name ps-1 --name chief]

It writes DIR/ca.pem, ca.key, server.pem, server.key (the shards'), chief.pem, chief.key (the
chief's) and client.pem, client.key (the workers'); keys mode 0600, P-256. The server and chief
certificates name localhost, 127.0.0.1 and ::1 plus every --name. The chief's (common name
asyncps-chief, the default --chief-identity) is valid for client authentication too: the chief
serves workers and calls the shards with it, and under mTLS that name is what lets it call the
shards' chief-only methods; a worker's client certificate (asyncps-client) cannot.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

# cryptography is imported where certificates are made, not here: every command line builds its parser
# with this module, the shard's too, and the slim shard image installs only numpy, grpcio and protobuf
if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

DEFAULT_NAMES = ("localhost", "127.0.0.1", "::1")
DEFAULT_DAYS = 30
CHIEF_COMMON_NAME = "asyncps-chief"  # asyncps.net.authz.DEFAULT_CHIEF_IDENTITY
SERVER_COMMON_NAME = "asyncps-server"  # the shards' certificate
# Host names (with an optional leading wildcard label) or IP literals.
_HOST_NAME = re.compile(r"^(\*\.)?[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")


@dataclass(frozen=True)
class DevCerts:
    """Paths of one generated set of development certificates."""

    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    chief_cert: Path
    chief_key: Path


def cert_paths(directory: Path) -> DevCerts:
    """Where generate_dev_certs puts (or put) its files inside directory."""
    return DevCerts(
        ca_cert=directory / "ca.pem",
        ca_key=directory / "ca.key",
        server_cert=directory / "server.pem",
        server_key=directory / "server.key",
        client_cert=directory / "client.pem",
        client_key=directory / "client.key",
        chief_cert=directory / "chief.pem",
        chief_key=directory / "chief.key",
    )


def _names(extra_names: Sequence[str]) -> list[x509.GeneralName]:
    """The subjectAltName entries: defaults plus extra names, deduplicated, each checked."""
    from cryptography import x509

    entries: list[x509.GeneralName] = []
    for name in [*DEFAULT_NAMES, *extra_names]:
        entry: x509.GeneralName
        try:
            entry = x509.IPAddress(ipaddress.ip_address(name))
        except ValueError:
            if not _HOST_NAME.match(name):
                raise ValueError(f"not a host name or IP address: {name!r}") from None
            entry = x509.DNSName(name)
        if entry not in entries:
            entries.append(entry)
    return entries


def subject_alt_names(extra_names: Sequence[str] = ()) -> str:
    """The server certificate's names as openssl spells them ("DNS:localhost, IP:127.0.0.1, ...")."""
    from cryptography import x509

    return ", ".join(f"IP:{n.value}" if isinstance(n, x509.IPAddress) else f"DNS:{n.value}"
                     for n in _names(extra_names))


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    """The key as unencrypted PKCS#8 PEM, in a file only its owner can read (created so)."""
    from cryptography.hazmat.primitives import serialization

    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.chmod(path, 0o600)


def _certificate(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Certificate | None,
                 issuer_key: ec.EllipticCurvePrivateKey, days: int, usages: Sequence[x509.ObjectIdentifier],
                 names: Sequence[x509.GeneralName]) -> x509.Certificate:
    """A CA certificate (no issuer: self-signed, may sign leaves) or a leaf signed by `issuer`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    public = key.public_key()
    builder = (x509.CertificateBuilder().subject_name(name)
               .issuer_name(issuer.subject if issuer is not None else name)
               .public_key(public).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False))
    if issuer is None:
        builder = (builder.add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                   .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                                key_encipherment=False, data_encipherment=False, key_agreement=False,
                                                key_cert_sign=True, crl_sign=True, encipher_only=False,
                                                decipher_only=False), critical=True))
    else:
        builder = (builder.add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                                key_encipherment=False, data_encipherment=False, key_agreement=False,
                                                key_cert_sign=False, crl_sign=False, encipher_only=False,
                                                decipher_only=False), critical=True)
                   .add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
                   .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
                                  critical=False))
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(list(names)), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _require_cryptography() -> None:
    """Raise a ValueError that says how to install `cryptography` (the `certs` extra) when it is missing."""
    try:
        import cryptography  # noqa: F401 - only asked whether it is there
    except ImportError:
        raise ValueError("development certificates need the cryptography library: "
                         "pip install 'asyncps[certs]' (or pip install cryptography)") from None


def generate_dev_certs(directory: Path, extra_names: Sequence[str] = (), days: int = DEFAULT_DAYS,
                       overwrite: bool = False) -> DevCerts:
    """Write a new CA, a server and a chief certificate (localhost, 127.0.0.1, ::1 + extra_names)
    and a client certificate into directory; refuse to replace existing files unless overwrite."""
    _require_cryptography()
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    if days < 1:
        raise ValueError(f"days must be at least 1, got {days}")
    names = _names(extra_names)
    paths = cert_paths(directory)
    existing = [p.name for p in vars(paths).values() if p.exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{directory} already holds {', '.join(existing)}; "
                              "pass --force (overwrite=True) to replace them")
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("asyncps development CA", ca_key, None, ca_key, days, (), ())
    server, client = ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH
    leaves = ((paths.server_cert, paths.server_key, SERVER_COMMON_NAME, (server, client), names),
              (paths.client_cert, paths.client_key, "asyncps-client", (client,), ()),
              (paths.chief_cert, paths.chief_key, CHIEF_COMMON_NAME, (server, client), names))
    _write_key(paths.ca_key, ca_key)
    paths.ca_cert.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    for cert_path, key_path, common_name, usages, leaf_names in leaves:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _certificate(common_name, key, ca, ca_key, days, usages, leaf_names)
        _write_key(key_path, key)
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return paths


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The devcerts command line (also `asyncps devcerts`)."""
    parser.add_argument("directory", type=Path,
                        help="where to write ca.pem, server.pem, chief.pem, client.pem and keys")
    parser.add_argument("--name", action="append", default=[], metavar="HOST",
                        help="extra server name (repeatable), e.g. --name ps-0 --name chief")
    parser.add_argument("--days", type=int, default=DEFAULT_DAYS, help="validity in days")
    parser.add_argument("--force", action="store_true", help="replace existing files")


def cmd_devcerts(args: argparse.Namespace) -> int:
    """Generate development certificates into a directory (exit 2 with a message on a mistake)."""
    try:
        paths = generate_dev_certs(args.directory, args.name, args.days, overwrite=args.force)
    except (ValueError, FileExistsError) as exc:
        print(f"asyncps devcerts: {exc}", file=sys.stderr)
        return 2
    print(f"wrote development certificates to {paths.ca_cert.parent} "
          f"(server names: {subject_alt_names(args.name)})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: generate development certificates into a directory."""
    parser = argparse.ArgumentParser(prog="asyncps devcerts", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return cmd_devcerts(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
