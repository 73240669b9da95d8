"""HTTPS for a classroom box (issue 14): --tls-self-signed makes a classroom CA once and a
server certificate for this machine's names, the server speaks TLS with it, offers the CA at
/ca.crt, and a client that trusts that CA (and nothing else) verifies the server."""

from __future__ import annotations

import ssl
import urllib.request

from cryptography import x509

from streamserver.tls import fingerprint, machine_names, self_signed
from tests.server_process import ServerProcess


def test_the_classroom_ca_is_made_once_and_its_certificate_names_this_machine(tmp_path):
    first = self_signed(tmp_path / "tls")
    ca_before = first.ca_cert.read_bytes()
    again = self_signed(tmp_path / "tls", public_url="https://class.school.example")
    assert again.ca_cert.read_bytes() == ca_before  # reused, so devices trust it once
    cert = x509.load_pem_x509_certificate(again.cert.read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    names, addresses = machine_names("https://class.school.example")
    assert set(sans.get_values_for_type(x509.DNSName)) >= {"localhost", "class.school.example", *names}
    assert {str(a) for a in sans.get_values_for_type(x509.IPAddress)} >= {"127.0.0.1", *addresses}
    assert (tmp_path / "tls" / "ca.key").stat().st_mode & 0o077 == 0  # the keys are private


def test_serve_speaks_https_with_its_classroom_ca(tmp_path):
    with ServerProcess("--tls-self-signed", str(tmp_path / "tls"), "--demo-room", "TLS class") as server:
        ca = tmp_path / "tls" / "ca.crt"
        context = ssl.create_default_context(cafile=str(ca))
        https = server.url.replace("http://", "https://")
        with urllib.request.urlopen(https + "/healthz", context=context, timeout=10) as r:
            assert r.status == 200
        with urllib.request.urlopen(https + "/ca.crt", context=context, timeout=10) as r:
            assert r.read() == ca.read_bytes()
        with urllib.request.urlopen(https + "/ca", context=context, timeout=10) as r:
            assert fingerprint(ca) in r.read().decode()
        log = server.log.read_text()
        assert fingerprint(ca) in log and "student: https://" in log
