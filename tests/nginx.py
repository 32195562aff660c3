"""The real nginx in front of surge nodes, from ops/nginx's template (tests, benchmarks)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tests.server import free_port

RENDER = Path(__file__).parent.parent / "ops" / "nginx" / "render.py"


def nginx_binary() -> str:
    found = shutil.which("nginx") or "/usr/sbin/nginx"
    if not os.path.exists(found):
        raise RuntimeError("nginx is not installed (make test installs Debian's nginx)")
    return found


def self_signed_certificate(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for localhost and 127.0.0.1: (cert, key)."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext",
                    "subjectAltName=DNS:localhost,IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


class NginxProcess:
    def __init__(self, nodes: list[str], folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.cert, key = self_signed_certificate(folder)
        self.http_port, self.https_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.tls_url = f"https://127.0.0.1:{self.https_port}"
        snippet = subprocess.run(
            [sys.executable, str(RENDER), *(a for n in nodes for a in ("--node", n)),
             "--cert", str(self.cert), "--key", str(key),
             "--http-listen", f"127.0.0.1:{self.http_port}",
             "--https-listen", f"127.0.0.1:{self.https_port}"],
            check=True, capture_output=True, text=True).stdout
        (folder / "surge.conf").write_text(snippet)
        self.access_log = folder / "access.log"
        self.error_log = folder / "error.log"
        # As root, nginx's workers would run as nobody, who cannot enter pytest's tmp dirs.
        user = "user root;" if os.geteuid() == 0 else ""
        temp = " ".join(f"{kind}_temp_path {folder}/{kind};"
                        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        (folder / "nginx.conf").write_text(f"""
{user}
daemon off;
worker_processes 1;
pid {folder}/nginx.pid;
error_log {self.error_log} info;
events {{ worker_connections 4096; }}
http {{
    log_format surge '$status upstream=$upstream_addr upstream_status=$upstream_status '
                     'session=$http_x_session_id rt=$request_time';
    access_log {self.access_log} surge;
    {temp}
    include {folder}/surge.conf;
}}
""")
        binary = nginx_binary()
        subprocess.run([binary, "-t", "-p", str(folder), "-c", str(folder / "nginx.conf"),
                        "-e", str(self.error_log)], check=True, capture_output=True)
        self.proc = subprocess.Popen([binary, "-p", str(folder), "-c", str(folder / "nginx.conf"),
                                      "-e", str(self.error_log)])
        self._wait_listening()

    def _wait_listening(self, timeout: float = 10) -> None:
        import socket

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.https_port), 0.5).close()
                return
            except OSError:
                time.sleep(0.1)
        raise TimeoutError(f"nginx did not listen:\n{self.error_log.read_text()}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
