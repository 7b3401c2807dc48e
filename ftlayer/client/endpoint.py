"""What a client is given to reach a server: its address (`parse_address`), its token
(`read_token_file`) and its TLS (`client_tls_context`, and `trusted_cas`, how error
messages name the CAs it trusts)."""

from __future__ import annotations

import os
import ssl

from ftlayer.errors import ConfigError

__all__ = ["client_tls_context", "parse_address", "read_token_file", "trusted_cas"]


def read_token_file(path: str) -> bytes:
    """The token in `path`: its bytes without a trailing newline; ConfigError if empty."""
    try:
        with open(path, "rb") as file:
            token = file.read()
    except OSError as exc:
        raise ConfigError(f"cannot read token file {path}: {exc.strerror}") from None
    token = token.removesuffix(b"\n").removesuffix(b"\r")
    if not token:
        raise ConfigError(f"token file {path} is empty")
    return token


def client_tls_context(
    tls: bool | str | os.PathLike[str] | ssl.SSLContext,
) -> ssl.SSLContext | None:
    """The client's TLS context: None for False (plain TCP); the system's trusted CAs for
    True; the CA certificate(s) in a PEM file for a path; or a caller's own context.
    The server's certificate and host name are always checked."""
    if tls is False:
        return None
    if isinstance(tls, ssl.SSLContext):
        return tls
    cafile = None if tls is True else os.fspath(tls)
    try:
        context = ssl.create_default_context(cafile=cafile)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load the TLS CA file {cafile}: {exc}") from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def parse_address(address: str) -> tuple[str, int]:
    """ "host:port" (or "[v6]:port") as (host, port); ConfigError if it is not one."""
    host, sep, port_text = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(f"server address must be HOST:PORT, got {address!r}")
    return host, int(port_text)


def trusted_cas(tls: bool | str | os.PathLike[str] | ssl.SSLContext) -> str:
    """The CAs a client trusts, as its error messages name them."""
    if tls is True:
        return "the system's trusted CAs"
    if isinstance(tls, ssl.SSLContext):
        return "the CAs of the client's SSL context"
    return "no CA (plain TCP)" if tls is False else f"the CA in {os.fspath(tls)}"
