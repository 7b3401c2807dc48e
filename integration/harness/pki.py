"""The TLS files and the token of an FT-layer server, made the way docs/deploy.md
(section 2) tells an operator to make them: a CA, a server key and certificate signed
by it whose subjectAltName names every host and address clients connect to, and a
token of 32 random bytes as hex. openssl does the work, as in the guide.

`make_server_files(directory, names)` writes them into `directory` (mode 0700):
`ca.pem` (what every client needs: `ft.tlsCa`, `--tls-ca`), `ca.key`, `server.pem`,
`server.key` and `token` (`ft.tokenFile`, `--token-file`). A name that parses as an
IP address becomes an `IP:` entry of the subjectAltName, any other a `DNS:` entry.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ftlayer.errors import FTLayerError

__all__ = ["PkiError", "ServerFiles", "make_server_files"]

_CA_DAYS = "3650"
_CERT_DAYS = "825"


class PkiError(FTLayerError):
    """openssl is missing or refused to make a file; the message has its output."""


@dataclass(frozen=True)
class ServerFiles:
    """Where `make_server_files` put each file."""

    ca: Path
    """The CA certificate: every client's `ft.tlsCa` / `--tls-ca`."""
    cert: Path
    """The server's certificate: `ftlayer serve --tls-cert`."""
    key: Path
    """The server's private key: `ftlayer serve --tls-key`."""
    token: Path
    """The token: `ftlayer serve --token-file` and the driver's `ft.tokenFile`."""

    def serve_args(self) -> tuple[str, ...]:
        """The arguments of `ftlayer serve` that use these files."""
        return (
            "--token-file", str(self.token),
            "--tls-cert", str(self.cert),
            "--tls-key", str(self.key),
        )  # fmt: skip

    def source_options(self) -> dict[str, str]:
        """The `ftkafka` source's options that use these files (beside ft.address)."""
        return {"ft.tokenFile": str(self.token), "ft.tlsCa": str(self.ca)}


def _subject_alt_name(names: Sequence[str]) -> str:
    entries = []
    for name in names:
        try:
            ipaddress.ip_address(name)
        except ValueError:
            entries.append(f"DNS:{name}")
        else:
            entries.append(f"IP:{name}")
    return ", ".join(entries)


def _openssl(directory: Path, *args: str) -> None:
    done = subprocess.run(
        ["openssl", *args], cwd=directory, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise PkiError(f"openssl {args[0]} failed ({done.returncode}): {done.stderr.strip()}")


def make_server_files(directory: str | os.PathLike[str], names: Sequence[str]) -> ServerFiles:
    """Make the CA, the server's key and certificate for `names` (its first name is the
    certificate's CN) and a token in `directory`; PkiError if openssl is missing or fails."""
    if not names:
        raise PkiError("a server certificate needs at least one host name or address")
    if shutil.which("openssl") is None:
        raise PkiError("openssl is not on PATH: it makes the CA and the server certificate")
    where = Path(directory)
    where.mkdir(mode=0o700, parents=True, exist_ok=True)
    ec_key = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes")
    _openssl(
        where, "req", "-x509", *ec_key, "-days", _CA_DAYS, "-subj", "/CN=ftlayer CA",
        "-keyout", "ca.key", "-out", "ca.pem",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    (where / "server.ext").write_text(
        f"subjectAltName = {_subject_alt_name(names)}\n"
        "basicConstraints = critical, CA:FALSE\n"
        "keyUsage = critical, digitalSignature\n"
        "extendedKeyUsage = serverAuth\n"
        "subjectKeyIdentifier = hash\n"
        "authorityKeyIdentifier = keyid\n"
    )
    _openssl(
        where, "req", *ec_key, "-subj", f"/CN={names[0]}",
        "-keyout", "server.key", "-out", "server.csr",
    )  # fmt: skip
    _openssl(
        where, "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", _CERT_DAYS, "-extfile", "server.ext", "-out", "server.pem",
    )  # fmt: skip
    token = where / "token"
    token.write_text(secrets.token_hex(32) + "\n")
    token.chmod(0o600)
    return ServerFiles(
        ca=where / "ca.pem", cert=where / "server.pem", key=where / "server.key", token=token
    )
