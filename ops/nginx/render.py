"""Fill ops/nginx/surge.conf.template for N surge nodes (an http {} snippet for conf.d/).

    python ops/nginx/render.py --node 10.0.0.1:8000 --node 10.0.0.2:8000 \
        --cert /etc/ssl/surge.pem --key /etc/ssl/surge.key > /etc/nginx/conf.d/surge.conf
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from pathlib import Path

TEMPLATE = Path(__file__).with_name("surge.conf.template")
# nginx 1.25.1 added `http2 on;` and deprecated `listen ... http2` (which it still takes).
HTTP2_DIRECTIVE = (1, 25, 1)


def parse_version(text: str) -> tuple[int, ...]:
    match = re.search(r"(\d+)\.(\d+)\.(\d+)", text)
    if match is None:
        raise ValueError(f"not an nginx version: {text!r}")
    return tuple(int(g) for g in match.groups())


def installed_nginx_version() -> tuple[int, ...] | None:
    """The version of the nginx on this machine (PATH, then /usr/sbin); None without one."""
    binary = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")
    if binary is None:
        return None
    return parse_version(subprocess.run([binary, "-v"], capture_output=True, text=True).stderr)


def render(nodes: list[str], cert: str, key: str, http_listen: str = "80",
           https_listen: str = "443", max_fails: int = 1, fail_timeout_s: int = 5,
           nginx_version: tuple[int, ...] | None = None) -> str:
    """The snippet; HTTP/2 as nginx_version takes it (unknown: the `listen ... http2` form,
    which every nginx with HTTP/2 accepts)."""
    servers = "\n".join(f"    server {node} max_fails={max_fails} fail_timeout={fail_timeout_s}s;"
                        for node in nodes)
    retry_servers = "\n".join(f"    server {node} max_fails=0;" for node in nodes)
    directive = nginx_version is not None and nginx_version >= HTTP2_DIRECTIVE
    fields = {"SERVERS": servers, "RETRY_SERVERS": retry_servers, "CERT": cert, "KEY": key,
              "HTTP_LISTEN": http_listen, "HTTPS_LISTEN": https_listen,
              "LISTEN_HTTP2": "" if directive else " http2",
              "HTTP2": "    http2 on;" if directive else
              "    # HTTP/2: `http2` on the listen line (nginx < 1.25.1 has no `http2 on;`)"}
    text = TEMPLATE.read_text()
    for name, value in fields.items():
        text = text.replace(f"@{name}@", value)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--node", action="append", required=True, help="HOST:PORT of a node")
    parser.add_argument("--cert", required=True, help="TLS certificate (PEM)")
    parser.add_argument("--key", required=True, help="its private key (PEM)")
    parser.add_argument("--http-listen", default="80", help="plain HTTP: [ADDRESS:]PORT")
    parser.add_argument("--https-listen", default="443", help="TLS + HTTP/2: [ADDRESS:]PORT")
    parser.add_argument("--max-fails", type=int, default=1)
    parser.add_argument("--fail-timeout-s", type=int, default=5)
    parser.add_argument("--nginx-version", type=parse_version, default=None, metavar="X.Y.Z",
                        help="the nginx that will load the snippet (default: this machine's; "
                             "without one, a form every version takes)")
    args = parser.parse_args()
    version = args.nginx_version or installed_nginx_version()
    print(render(args.node, args.cert, args.key, args.http_listen, args.https_listen,
                 args.max_fails, args.fail_timeout_s, version), end="")


if __name__ == "__main__":
    main()
