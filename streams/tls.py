"""A throw-away certificate authority and a broker certificate for the local broker's TLS listener, made with the
Java keytool (it ships with the Java runtime the broker needs already).

    make_ca_and_broker_cert(folder, hostnames=["localhost"], ips=["127.0.0.1"]) -> {
        "ca": folder/ca.pem,                      # the CA certificate: clients trust it (ssl_cafile)
        "keystore": folder/broker.p12,            # the broker's key and certificate chain (PKCS12)
        "keystore_password_file": folder/broker.p12.password}

The CA's private key stays in `folder/ca.p12` (mode 0600); store passwords are random, passed to keytool by
environment variable (never on a command line), and written to 0600 files beside their stores.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from pathlib import Path

__all__ = ["TlsError", "find_keytool", "make_ca", "make_ca_and_broker_cert"]

VALIDITY_DAYS = 365


class TlsError(RuntimeError):
    """keytool is missing or failed."""


def find_keytool() -> str:
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "keytool").is_file():
        return str(Path(home) / "bin" / "keytool")
    tool = shutil.which("keytool")
    if tool:
        return tool
    java = shutil.which("java")
    if java:
        cand = Path(os.path.realpath(java)).parent / "keytool"
        if cand.is_file():
            return str(cand)
    raise TlsError("no `keytool` found (it comes with the Java runtime: JAVA_HOME/bin/keytool)")


def _write_secret(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(value + "\n")


def _keytool(*args: str, env: dict) -> None:
    cmd = [find_keytool(), *args]
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          env={**os.environ, **env}, timeout=120)
    if proc.returncode != 0:
        raise TlsError(f"keytool {args[0]} failed (exit {proc.returncode}): "
                       f"{proc.stdout.decode('utf-8', 'replace').strip()[-800:]}")


def make_ca(folder: Path, name: str = "ca", cn: str = "chipledger local CA") -> dict[str, Path]:
    """A self-signed CA: `folder/<name>.p12` (its key, 0600) and `folder/<name>.pem` (its certificate)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    store, pem, pw_file = folder / f"{name}.p12", folder / f"{name}.pem", folder / f"{name}.p12.password"
    pw = secrets.token_urlsafe(24)
    env = {"CHIPLEDGER_CA_STOREPASS": pw}
    for p in (store, pem):
        p.unlink(missing_ok=True)
    _keytool("-genkeypair", "-alias", "ca", "-keystore", str(store), "-storetype", "PKCS12",
             "-storepass:env", "CHIPLEDGER_CA_STOREPASS", "-keyalg", "RSA", "-keysize", "2048",
             "-dname", f"CN={cn}", "-ext", "bc:c", "-validity", str(VALIDITY_DAYS), env=env)
    os.chmod(store, 0o600)
    _write_secret(pw_file, pw)
    _keytool("-exportcert", "-rfc", "-alias", "ca", "-keystore", str(store), "-storepass:env",
             "CHIPLEDGER_CA_STOREPASS", "-file", str(pem), env=env)
    return {"ca": pem, "ca_store": store, "ca_password_file": pw_file}


def make_ca_and_broker_cert(folder: Path, hostnames=("localhost",), ips=("127.0.0.1",)) -> dict[str, Path]:
    """A new CA and a broker key + certificate signed by it for `hostnames` and `ips` (subject alternative
    names, so clients that check host names accept it at 127.0.0.1 and at localhost)."""
    folder = Path(folder)
    ca = make_ca(folder)
    ca_pw = ca["ca_password_file"].read_text().strip()
    pw = secrets.token_urlsafe(24)
    env = {"CHIPLEDGER_CA_STOREPASS": ca_pw, "CHIPLEDGER_BROKER_STOREPASS": pw}
    store, csr, cert = folder / "broker.p12", folder / "broker.csr", folder / "broker.pem"
    for p in (store, csr, cert):
        p.unlink(missing_ok=True)
    names = [h for h in hostnames if h]
    san = ",".join([f"dns:{h}" for h in names] + [f"ip:{i}" for i in ips if i])
    common = ["-keystore", str(store), "-storepass:env", "CHIPLEDGER_BROKER_STOREPASS"]
    _keytool("-genkeypair", "-alias", "broker", *common, "-storetype", "PKCS12", "-keyalg", "RSA",
             "-keysize", "2048", "-dname", f"CN={names[0] if names else 'localhost'}",
             "-validity", str(VALIDITY_DAYS), env=env)
    os.chmod(store, 0o600)
    _keytool("-certreq", "-alias", "broker", *common, "-file", str(csr), env=env)
    _keytool("-gencert", "-alias", "ca", "-keystore", str(ca["ca_store"]), "-storepass:env",
             "CHIPLEDGER_CA_STOREPASS", "-infile", str(csr), "-outfile", str(cert), "-rfc",
             "-ext", f"SAN={san}", "-ext", "ku:c=digitalSignature,keyEncipherment", "-ext", "eku=serverAuth",
             "-validity", str(VALIDITY_DAYS), env=env)
    _keytool("-importcert", "-alias", "ca", *common, "-file", str(ca["ca"]), "-noprompt", env=env)
    _keytool("-importcert", "-alias", "broker", *common, "-file", str(cert), "-noprompt", env=env)
    pw_file = folder / "broker.p12.password"
    _write_secret(pw_file, pw)
    csr.unlink(missing_ok=True)
    return {**ca, "keystore": store, "keystore_password_file": pw_file, "cert": cert}
