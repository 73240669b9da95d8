"""HTTPS for a classroom box on a school network.

Browsers give a page the microphone only on https (or localhost), so a box that students reach
over the LAN must serve TLS. Either the school's own certificate (`--tls-cert`, `--tls-key`), or
`--tls-self-signed DIR`: a local certificate authority made once in DIR and reused, and a server
certificate it signs for this machine's names and LAN addresses (and the `--public-url` host).
Students' devices trust the CA once (the server offers it at /ca.crt, with instructions at /ca);
its SHA-256 fingerprint is printed at start, to compare with what a device shows.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_DAYS = 3650
SERVER_DAYS = 397  # what browsers accept for a leaf certificate


class TlsError(ValueError):
    """A certificate or key that cannot be used (the message says which and why)."""


@dataclass(frozen=True)
class Tls:
    cert: Path
    key: Path
    ca_cert: Path | None = None  # the self-signed CA, offered at /ca.crt

    def context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as error:
            raise TlsError(f"cannot use {self.cert} with {self.key}: {error}") from None
        return context


def machine_names(public_url: str | None = None) -> tuple[list[str], list[str]]:
    """(DNS names, IP addresses) a student may reach this machine by."""
    names = {"localhost", socket.gethostname(), socket.getfqdn()}
    addresses = {"127.0.0.1", "::1"}
    try:
        import ifaddr  # aioice's dependency: every interface's addresses

        for adapter in ifaddr.get_adapters():
            for ip in adapter.ips:
                address = ip.ip if isinstance(ip.ip, str) else ip.ip[0]
                if not ipaddress.ip_address(address.split("%")[0]).is_link_local:
                    addresses.add(address.split("%")[0])
    except ImportError:
        pass
    if public_url and (host := urlsplit(public_url).hostname):
        try:
            addresses.add(str(ipaddress.ip_address(host)))
        except ValueError:
            names.add(host)
    return sorted(n for n in names if n), sorted(addresses)


def self_signed(directory: Path, public_url: str | None = None) -> Tls:
    """The CA in `directory` (made on first use) and a server certificate for this machine's
    names, made again whenever the names change or it nears its end."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key_path, ca_path = directory / "ca.key", directory / "ca.crt"
    if not ca_path.exists():
        _write_ca(ca_key_path, ca_path)
    ca_key = serialization.load_pem_private_key(ca_key_path.read_bytes(), None)
    ca = x509.load_pem_x509_certificate(ca_path.read_bytes())
    names, addresses = machine_names(public_url)
    key_path, cert_path = directory / "server.key", directory / "server.crt"
    if not _still_good(cert_path, names, addresses):
        _write_server(ca, ca_key, names, addresses, key_path, cert_path)
    return Tls(cert_path, key_path, ca_path)


def fingerprint(cert_path: Path) -> str:
    digest = x509.load_pem_x509_certificate(cert_path.read_bytes()).fingerprint(hashes.SHA256())
    return ":".join(f"{b:02X}" for b in digest)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _write_private(path: Path, data: bytes) -> None:
    path.touch(mode=0o600, exist_ok=True)
    path.write_bytes(data)


def _write_ca(key_path: Path, cert_path: Path) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"streamserver classroom CA ({socket.gethostname()})")])
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - datetime.timedelta(days=1)).not_valid_after(_now() + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .sign(key, hashes.SHA256())
    )
    _write_private(key_path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _still_good(cert_path: Path, names: list[str], addresses: list[str]) -> bool:
    if not cert_path.exists():
        return False
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    if cert.not_valid_after_utc - _now() < datetime.timedelta(days=30):
        return False
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    have = set(sans.get_values_for_type(x509.DNSName)) | {str(a) for a in sans.get_values_for_type(x509.IPAddress)}
    return have >= set(names) | set(addresses)


def _write_server(ca: x509.Certificate, ca_key, names: list[str], addresses: list[str],  # noqa: ANN001 - a private key
                  key_path: Path, cert_path: Path) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    sans = [x509.DNSName(n) for n in names] + [x509.IPAddress(ipaddress.ip_address(a)) for a in addresses]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0] if names else "streamserver")]))
        .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(_now() - datetime.timedelta(days=1)).not_valid_after(_now() + datetime.timedelta(days=SERVER_DAYS))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    _write_private(key_path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
