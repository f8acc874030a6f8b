"""The console's certificate authority for engines: engines answer only callers holding a
certificate it issued (docs/security.md, "Engines answer only the console").

Every engine serves TLS with its node's certificate and requires a client certificate from
this CA (vLLM's `--ssl-certfile`, `--ssl-keyfile`, `--ssl-ca-certs`, `--ssl-cert-reqs 2`); the
gateway, the control worker and the node agents call engines with theirs (`client_context()`).

The files live in `ENGINE_TLS_DIR` (keys 0600, the folder 0700; the CA's two in
`ENGINE_CA_DIR` where that is set):

- `ca.pem`: the console CA's certificate (every host);
- `ca.key`: the CA's key (the console's hosts only: never handed to a node);
- `console.pem`, `console.key`: the console's client certificate (gateway, control worker);
- `node.pem`, `node.key`: this host's; its engines serve with it, its agent calls them with it.

On the console's hosts all of them are made on first use (`ensure_local()`); a joined node
gets `ca.pem` and its own `node.pem`/`node.key` from the join exchange (`issue_node()`), never
the CA's key nor the console's.
"""

from __future__ import annotations

import datetime
import fcntl
import ipaddress
import os
import ssl
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from django.conf import settings

CA_NAME = "LLM console engine CA"
CA_DAYS = 3650
LEAF_DAYS = 825
# The names every host's own engines are reached by on the host itself.
LOCAL_NAMES = ("127.0.0.1", "::1", "localhost")


@dataclass(frozen=True)
class Issued:
    """A certificate and its key, as PEM."""

    cert_pem: str
    key_pem: str


def directory() -> Path:
    return Path(settings.ENGINE_TLS_DIR)


def ca_directory() -> Path:
    """Where `ca.pem` (and on the console's hosts `ca.key`) are: `ENGINE_CA_DIR` where set (a
    mounted secret, read only: Kubernetes), else `ENGINE_TLS_DIR`."""
    return Path(settings.ENGINE_CA_DIR) if settings.ENGINE_CA_DIR else directory()


def ca_cert_path() -> Path:
    return ca_directory() / "ca.pem"


def node_paths() -> tuple[Path, Path]:
    """This host's engine certificate and key (the engines' `--ssl-certfile`/`--ssl-keyfile`)."""
    return directory() / "node.pem", directory() / "node.key"


def client_paths() -> tuple[Path, Path]:
    """The certificate this process calls engines with: the console's on its hosts, else the
    node's."""
    console = directory() / "console.pem", directory() / "console.key"
    return console if console[0].exists() else node_paths()


# -- the CA ----------------------------------------------------------------------------------
def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> str:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()).decode()


def _cert_pem(cert: x509.Certificate) -> str:
    return cert.public_bytes(serialization.Encoding.PEM).decode()


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def make_ca(name: str = CA_NAME) -> Issued:
    """A new self-signed CA that may sign leaf certificates only."""
    key = _new_key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = _now()
    cert = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, key_cert_sign=True, crl_sign=True,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                       critical=False)
        .sign(key, hashes.SHA256())
    )
    return Issued(_cert_pem(cert), _key_pem(key))


def _san(names: Iterable[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in dict.fromkeys(n.strip().strip("[]") for n in names if n.strip()):
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def issue(ca: Issued, common_name: str, *, names: Iterable[str] = (), server: bool = False,
          days: int = LEAF_DAYS) -> Issued:
    """A leaf certificate signed by `ca`: a client certificate, and with `server` also a server
    certificate for `names` (IP addresses or host names)."""
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem.encode())
    ca_key = serialization.load_pem_private_key(ca.key_pem.encode(), None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
        raise ValueError("the console CA's key must be an EC or RSA key")
    key = _new_key()
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH, *([ExtendedKeyUsageOID.SERVER_AUTH] if server
                                                 else [])]
    now = _now()
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                       critical=False)
    )
    if server:
        builder = builder.add_extension(_san(names), critical=False)
    return Issued(_cert_pem(builder.sign(ca_key, hashes.SHA256())), _key_pem(key))


def names_of(cert_pem: str) -> set[str]:
    """The IP addresses and host names a certificate is valid for."""
    cert = x509.load_pem_x509_certificate(cert_pem.encode())
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return {str(v) for v in san.get_values_for_type(x509.IPAddress)} | set(
        san.get_values_for_type(x509.DNSName))


def expires_soon(cert_pem: str, days: int = 30) -> bool:
    cert = x509.load_pem_x509_certificate(cert_pem.encode())
    return cert.not_valid_after_utc < _now() + datetime.timedelta(days=days)


# -- files -----------------------------------------------------------------------------------
@contextmanager
def _locked() -> Iterator[Path]:
    """The folder, made 0700, held against other processes making the same files."""
    folder = directory()
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    with (folder / ".lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield folder
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _write(path: Path, text: str, mode: int) -> None:
    """Written whole or not at all, with `mode` from the start (a key is never readable by
    others, not even for a moment)."""
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def write_pair(folder: Path, stem: str, issued: Issued) -> None:
    _write(folder / f"{stem}.key", issued.key_pem, 0o600)
    _write(folder / f"{stem}.pem", issued.cert_pem, 0o644)


def load_ca() -> Issued:
    """The console CA, made on first use (on a console host: a node has no `ca.key`)."""
    with _locked() as folder:
        return _ca_in(folder)


def _ca_in(folder: Path) -> Issued:
    """The CA of `ca_directory()`; made in `folder` when that is where it lives and it is
    not there yet."""
    ca_folder = ca_directory()
    if not (ca_folder / "ca.key").exists():
        if (ca_folder / "ca.pem").exists() or ca_folder != folder:
            raise FileNotFoundError(
                f"{ca_folder / 'ca.key'} is missing: this host has no key of the console CA "
                f"(a node's certificates come from its join; ENGINE_CA_DIR names a folder "
                f"that `manage.py engine_ca` fills)")
        write_pair(folder, "ca", make_ca())
    return Issued((ca_folder / "ca.pem").read_text(), (ca_folder / "ca.key").read_text())


def ensure_local(address: str = "") -> None:
    """On a console host: the CA, the console's client certificate and this host's engine
    certificate (for loopback and `address`), each made when missing, expiring or (the
    engine's) not valid for `address`. A node that joined has its files already: nothing."""
    if _ensured(address):
        return
    with _locked() as folder:
        if ca_cert_path().exists() and not (ca_directory() / "ca.key").exists():
            return  # a joined node
        ca = _ca_in(folder)
        if _stale(folder / "console.pem", ()):
            write_pair(folder, "console", issue(ca, "console"))
        names = [*LOCAL_NAMES, address]
        if _stale(folder / "node.pem", names):
            write_pair(folder, "node", issue(ca, "node:local", names=names, server=True))
    _ensured_for.add(address)


_ensured_for: set[str] = set()


def _ensured(address: str) -> bool:
    return address in _ensured_for and all(
        p.exists() for p in (ca_cert_path(), *node_paths(), *client_paths()))


def _stale(cert: Path, names: Iterable[str]) -> bool:
    if not cert.exists() or not cert.with_suffix(".key").exists():
        return True
    pem = cert.read_text()
    wanted = {str(ipaddress.ip_address(n)) if _is_ip(n) else n for n in names if n}
    return expires_soon(pem) or not wanted <= names_of(pem)


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def issue_node(node_name: str, address: str) -> dict[str, str]:
    """What a joining node gets: the CA's certificate and a certificate of its own (its engines
    serve with it for loopback and `address`; its agent calls engines with it), with its key.
    The key is made here and travels once in the join's answer (HTTPS in production)."""
    ca = load_ca()
    node = issue(ca, f"node:{node_name}", names=[*LOCAL_NAMES, address], server=True)
    return {"ca.pem": ca.cert_pem, "node.pem": node.cert_pem, "node.key": node.key_pem}


# -- contexts --------------------------------------------------------------------------------
def client_context(cafile: Path | None = None, certfile: Path | None = None,
                   keyfile: Path | None = None) -> ssl.SSLContext:
    """A context for calling engines: trusts the console CA alone (not the system's roots),
    checks the engine's name, presents this process's certificate."""
    if certfile is None or keyfile is None:
        certfile, keyfile = client_paths()
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH,
                                         cafile=str(cafile or ca_cert_path()))
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(str(certfile), str(keyfile))
    return context


def engine_server_context(folder: Path) -> ssl.SSLContext:
    """What an engine's server (uvicorn) makes of `tls_arguments()`'s flags for the files in
    `folder`: its certificate, the CA's, a client certificate required. For tests and
    benchmarks that stand in for an engine."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(folder / "node.pem", folder / "node.key")
    context.load_verify_locations(folder / "ca.pem")
    context.verify_mode = ssl.CERT_REQUIRED  # --ssl-cert-reqs 2
    return context


@cache
def shared_client_context() -> ssl.SSLContext:
    """One client context per process (loading it costs more than a handshake)."""
    ensure_local(os.environ.get("NODE_ADDRESS", ""))
    return client_context()


def engine_scheme() -> str:
    return "https" if settings.ENGINE_TLS else "http"
