"""The console's engine CA (serving_app/pki.py): certificates it issues verify against it, name
what they are for and expire; a certificate of another CA is refused by an engine's context."""

from __future__ import annotations

import datetime
import os
import socket
import ssl
import threading

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from django.core.management import CommandError, call_command
from django.test import override_settings

from serving_app import pki


def test_local_files_are_made_once_with_private_keys(tls_dir):
    pki.ensure_local("10.0.0.7")
    names = {p.name for p in tls_dir.iterdir()}
    assert {"ca.pem", "ca.key", "console.pem", "console.key", "node.pem", "node.key"} <= names
    for key in ("ca.key", "console.key", "node.key"):
        assert os.stat(tls_dir / key).st_mode & 0o777 == 0o600
    assert os.stat(tls_dir).st_mode & 0o777 == 0o700
    ca_before = (tls_dir / "ca.pem").read_text()
    pki._ensured_for.clear()
    pki.ensure_local("10.0.0.7")
    assert (tls_dir / "ca.pem").read_text() == ca_before


def test_node_certificate_names_loopback_and_the_address(tls_dir):
    pki.ensure_local("10.0.0.7")
    assert pki.names_of(pki.node_paths()[0].read_text()) == {"127.0.0.1", "::1", "localhost",
                                                              "10.0.0.7"}
    pki._ensured_for.clear()
    pki.ensure_local("gpu-a.example")  # a new address: a new certificate
    assert "gpu-a.example" in pki.names_of(pki.node_paths()[0].read_text())


def test_issued_certificates_chain_to_the_ca_and_expire():
    ca = pki.make_ca()
    leaf = pki.issue(ca, "node:a", names=["10.1.2.3"], server=True)
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem.encode())
    cert = x509.load_pem_x509_certificate(leaf.cert_pem.encode())
    cert.verify_directly_issued_by(ca_cert)
    lifetime = cert.not_valid_after_utc - datetime.datetime.now(datetime.UTC)
    assert datetime.timedelta(days=pki.LEAF_DAYS - 1) < lifetime <= datetime.timedelta(
        days=pki.LEAF_DAYS)
    assert not pki.expires_soon(leaf.cert_pem)
    assert pki.expires_soon(pki.issue(ca, "short", days=1).cert_pem)
    with pytest.raises((ValueError, InvalidSignature)):
        cert.verify_directly_issued_by(
            x509.load_pem_x509_certificate(pki.make_ca().cert_pem.encode()))


def test_a_joining_node_gets_its_certificate_never_the_cas_key(tls_dir):
    files = pki.issue_node("gpu-b", "10.9.8.7")
    assert set(files) == {"ca.pem", "node.pem", "node.key"}
    assert "10.9.8.7" in pki.names_of(files["node.pem"])
    assert files["ca.pem"] == (tls_dir / "ca.pem").read_text()


def test_a_joined_node_makes_no_ca_of_its_own(tmp_path):
    ca = pki.make_ca()
    node = pki.issue(ca, "node:x", names=["127.0.0.1"], server=True)
    folder = tmp_path / "node-tls"
    folder.mkdir()
    (folder / "ca.pem").write_text(ca.cert_pem)
    pki.write_pair(folder, "node", node)
    with override_settings(ENGINE_TLS_DIR=folder):
        pki._ensured_for.clear()
        pki.ensure_local("127.0.0.1")
        assert not (folder / "ca.key").exists()
        assert pki.client_paths() == pki.node_paths()
        with pytest.raises(FileNotFoundError):
            pki.load_ca()
    pki._ensured_for.clear()


def _handshake(server: ssl.SSLContext, client: ssl.SSLContext) -> bool:
    """Whether one TLS connection over a socket pair completes (both sides agree)."""
    left, right = socket.socketpair()
    outcome: dict[str, bool] = {}

    def serve() -> None:
        try:
            with server.wrap_socket(left, server_side=True) as tls:
                tls.recv(1)
                outcome["server"] = True
        except (ssl.SSLError, OSError):
            outcome["server"] = False

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        with client.wrap_socket(right, server_hostname="127.0.0.1") as tls:
            tls.sendall(b"x")
            tls.recv(1)  # the refusal arrives after the client's last flight (TLS 1.3)
    except (ssl.SSLError, OSError):
        pass
    thread.join(10)
    return outcome.get("server", False)


def test_engine_context_accepts_only_certificates_of_the_console_ca(tls_dir):
    pki.ensure_local("")
    server = pki.engine_server_context(tls_dir)
    assert _handshake(server, pki.client_context())
    # No certificate, trusting the CA.
    bare = ssl.create_default_context(cafile=str(tls_dir / "ca.pem"))
    assert not _handshake(server, bare)
    # A certificate of another CA.
    other = pki.make_ca("another CA")
    stranger = pki.issue(other, "stranger")
    pki.write_pair(tls_dir.parent, "stranger", stranger)
    foreign = ssl.create_default_context(cafile=str(tls_dir / "ca.pem"))
    foreign.load_cert_chain(tls_dir.parent / "stranger.pem", tls_dir.parent / "stranger.key")
    assert not _handshake(server, foreign)


def test_a_ca_from_engine_ca_dir_signs_each_process_certificates(tmp_path, tls_dir):
    """Kubernetes: the CA comes from a mounted secret that `manage.py engine_ca` filled; each
    pod makes its own certificates from it, and a second `engine_ca` never replaces it."""
    secret = tmp_path / "secret"
    call_command("engine_ca", out=str(secret))
    with pytest.raises(CommandError):
        call_command("engine_ca", out=str(secret))
    with override_settings(ENGINE_CA_DIR=str(secret)):
        pki.ensure_local("10.2.3.4")
        assert not (tls_dir / "ca.key").exists() and not (tls_dir / "ca.pem").exists()
        node = x509.load_pem_x509_certificate(pki.node_paths()[0].read_bytes())
        ca = x509.load_pem_x509_certificate((secret / "ca.pem").read_bytes())
        node.verify_directly_issued_by(ca)
        assert pki.client_paths()[0] == tls_dir / "console.pem"
