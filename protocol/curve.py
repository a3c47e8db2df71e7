"""ZeroMQ CURVE keys for engine cores reached over tcp. Imports no torch.

A key directory made by `pagoda curve-keys DIR` holds:
- server.key / server.key_secret: the engine core's key pair;
- client.key / client.key_secret: the key pair API servers present;
- clients/: the public keys the engine core admits (client.key at first;
  copy more there to admit other API servers).

The engine core encrypts both sockets and admits only connections whose
public key is in clients/ (checked by ZeroMQ's ZAP authenticator). Secret
files are 0600 and the directory 0700. Without keys, a tcp engine address
is bound to loopback only.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import zmq
import zmq.auth

logger = logging.getLogger("pagoda.curve")


def generate_keys(directory: str | Path) -> Path:
    """Create a key directory (refuses to overwrite an existing key pair)."""
    root = Path(directory)
    if (root / "server.key_secret").exists():
        raise FileExistsError(f"{root} already holds CURVE keys")
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    zmq.auth.create_certificates(root, "server")
    zmq.auth.create_certificates(root, "client")
    for secret in root.glob("*.key_secret"):
        os.chmod(secret, 0o600)
    clients = root / "clients"
    clients.mkdir(exist_ok=True)
    shutil.copy(root / "client.key", clients / "client.key")
    return root


def _load(path: Path) -> tuple[bytes, bytes | None]:
    if not path.exists():
        raise FileNotFoundError(f"missing CURVE key file {path} (make one: pagoda curve-keys DIR)")
    public, secret = zmq.auth.load_certificate(path)
    return public, secret


def secure_server(ctx: zmq.Context[Any], sockets: list[zmq.Socket[Any]], directory: str) -> Any:
    """Make `sockets` CURVE servers admitting the keys in DIR/clients/.

    Returns the running authenticator (stop it when the sockets close).
    Call before binding.
    """
    from zmq.auth.thread import ThreadAuthenticator

    root = Path(directory)
    public, secret = _load(root / "server.key_secret")
    clients = root / "clients"
    if not clients.is_dir() or not any(clients.glob("*.key")):
        raise FileNotFoundError(f"no admitted client keys in {clients}")
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(clients))
    for sock in sockets:
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True
    return auth


def secure_client(sockets: list[zmq.Socket[Any]], directory: str) -> None:
    """Make `sockets` CURVE clients of the engine whose key is in DIR. Call before connecting."""
    root = Path(directory)
    public, secret = _load(root / "client.key_secret")
    server_public, _ = _load(root / "server.key")
    for sock in sockets:
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_serverkey = server_public


def bind_address(address: str, curve_dir: str | None) -> str:
    """The address to bind: a non-loopback tcp host without keys falls back to loopback."""
    if curve_dir is not None or not address.startswith("tcp://"):
        return address
    host, _, port = address[len("tcp://") :].rpartition(":")
    if _is_loopback(host):
        return address
    logger.warning(
        "engine address %s has no CURVE keys (--curve-keys): binding to 127.0.0.1 only", address
    )
    return f"tcp://127.0.0.1:{port}"


def _is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
