"""Development certificates: a throwaway CA, a server and a client certificate, made with openssl.

For trying TLS/mTLS locally and in the compose file, never for production. Run it as

    python -m asyncps.tools.devcerts DIR [--name ps-0 --name ps-1 --name chief]

It writes DIR/ca.pem, ca.key, server.pem, server.key (the shards'), chief.pem, chief.key (the
chief's) and client.pem, client.key (the workers'); keys mode 0600. The server and chief
certificates name localhost, 127.0.0.1 and ::1 plus every --name. The chief's (common name
asyncps-chief, the default --chief-identity) is valid for client authentication too: the chief
serves workers and calls the shards with it, and under mTLS that name is what lets it call the
shards' chief-only methods; a worker's client certificate (asyncps-client) cannot.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

DEFAULT_NAMES = ("localhost", "127.0.0.1", "::1")
DEFAULT_DAYS = 30
CHIEF_COMMON_NAME = "asyncps-chief"  # asyncps.net.authz.DEFAULT_CHIEF_IDENTITY
# Host names (or IP literals): the names go into an openssl config file, so nothing else.
_HOST_NAME = re.compile(r"^(\*\.)?[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")

_CONFIG = """\
[req]
distinguished_name = dn
prompt = no

[dn]
CN = {common_name}

[v3_ca]
basicConstraints = critical, CA:TRUE, pathlen:0
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash

[v3_server]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth, clientAuth
subjectAltName = {subject_alt_names}
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid

[v3_client]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
"""


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


def subject_alt_names(extra_names: Sequence[str] = ()) -> str:
    """The subjectAltName value for the server certificate: defaults plus extra names, deduplicated."""
    entries: list[str] = []
    for name in [*DEFAULT_NAMES, *extra_names]:
        try:
            entry = f"IP:{ipaddress.ip_address(name)}"
        except ValueError:
            if not _HOST_NAME.match(name):
                raise ValueError(f"not a host name or IP address: {name!r}") from None
            entry = f"DNS:{name}"
        if entry not in entries:
            entries.append(entry)
    return ", ".join(entries)


def _openssl() -> str:
    found = shutil.which("openssl")
    if found is None:
        raise RuntimeError("generating development certificates needs the openssl command line tool")
    return found


def _run(openssl: str, *args: str) -> None:
    result = subprocess.run([openssl, *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {result.stderr.strip()}")


def _new_key_args(key_path: Path) -> list[str]:
    # P-256 keys: generated instantly, supported by every gRPC TLS stack.
    return ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key_path)]


def _serial() -> str:
    return f"0x{secrets.randbits(63):x}"


def _write_config(work: Path, common_name: str, sans: str) -> Path:
    config = work / f"{common_name.replace(' ', '-')}.cnf"
    config.write_text(_CONFIG.format(common_name=common_name, subject_alt_names=sans))
    return config


def _issue(openssl: str, work: Path, ca: DevCerts, cert: Path, key: Path, common_name: str,
           extensions: str, sans: str, days: int) -> None:
    """Create a key and a certificate for it signed by the CA."""
    config = _write_config(work, common_name, sans)
    csr = work / f"{cert.stem}.csr"
    _run(openssl, "req", "-new", *_new_key_args(key), "-config", str(config), "-out", str(csr))
    _run(openssl, "x509", "-req", "-in", str(csr), "-CA", str(ca.ca_cert), "-CAkey", str(ca.ca_key),
         "-set_serial", _serial(), "-days", str(days), "-sha256",
         "-extfile", str(config), "-extensions", extensions, "-out", str(cert))


def generate_dev_certs(directory: Path, extra_names: Sequence[str] = (), days: int = DEFAULT_DAYS,
                       overwrite: bool = False) -> DevCerts:
    """Write a new CA, a server and a chief certificate (localhost, 127.0.0.1, ::1 + extra_names)
    and a client certificate into directory; refuse to replace existing files unless overwrite."""
    if days < 1:
        raise ValueError(f"days must be at least 1, got {days}")
    sans = subject_alt_names(extra_names)
    openssl = _openssl()
    paths = cert_paths(directory)
    existing = [p.name for p in vars(paths).values() if p.exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{directory} already holds {', '.join(existing)}; "
                              "pass --force (overwrite=True) to replace them")
    directory.mkdir(parents=True, exist_ok=True)
    for key in (paths.ca_key, paths.server_key, paths.client_key, paths.chief_key):
        # created private before openssl writes into them (openssl keeps an existing file's mode)
        key.touch(mode=0o600)
        os.chmod(key, 0o600)
    with tempfile.TemporaryDirectory(prefix="asyncps-devcerts-") as tmp:
        work = Path(tmp)
        ca_config = _write_config(work, "asyncps development CA", sans)
        _run(openssl, "req", "-x509", *_new_key_args(paths.ca_key), "-config", str(ca_config),
             "-extensions", "v3_ca", "-set_serial", _serial(), "-days", str(days), "-sha256",
             "-out", str(paths.ca_cert))
        _issue(openssl, work, paths, paths.server_cert, paths.server_key, "asyncps-server",
               "v3_server", sans, days)
        _issue(openssl, work, paths, paths.client_cert, paths.client_key, "asyncps-client",
               "v3_client", sans, days)
        _issue(openssl, work, paths, paths.chief_cert, paths.chief_key, CHIEF_COMMON_NAME,
               "v3_server", sans, days)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: generate development certificates into a directory."""
    parser = argparse.ArgumentParser(prog="python -m asyncps.tools.devcerts", description=__doc__.split("\n")[0])
    parser.add_argument("directory", type=Path,
                        help="where to write ca.pem, server.pem, chief.pem, client.pem and keys")
    parser.add_argument("--name", action="append", default=[], metavar="HOST",
                        help="extra server name (repeatable), e.g. --name ps-0 --name chief")
    parser.add_argument("--days", type=int, default=DEFAULT_DAYS, help="validity in days")
    parser.add_argument("--force", action="store_true", help="replace existing files")
    args = parser.parse_args(argv)
    try:
        paths = generate_dev_certs(args.directory, args.name, args.days, overwrite=args.force)
    except (ValueError, RuntimeError, FileExistsError) as exc:
        print(f"asyncps devcerts: {exc}", file=sys.stderr)
        return 2
    print(f"wrote development certificates to {paths.ca_cert.parent} "
          f"(server names: {subject_alt_names(args.name)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
