"""Fill ops/nginx/surge.conf.template for N surge nodes (an http {} snippet for conf.d/).

    python ops/nginx/render.py --node 10.0.0.1:8000 --node 10.0.0.2:8000 \
        --cert /etc/ssl/surge.pem --key /etc/ssl/surge.key > /etc/nginx/conf.d/surge.conf
"""

from __future__ import annotations

import argparse
from pathlib import Path

TEMPLATE = Path(__file__).with_name("surge.conf.template")


def render(nodes: list[str], cert: str, key: str, http_listen: str = "80",
           https_listen: str = "443", max_fails: int = 1, fail_timeout_s: int = 5) -> str:
    servers = "\n".join(f"    server {node} max_fails={max_fails} fail_timeout={fail_timeout_s}s;"
                        for node in nodes)
    fields = {"SERVERS": servers, "CERT": cert, "KEY": key, "HTTP_LISTEN": http_listen,
              "HTTPS_LISTEN": https_listen}
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
    args = parser.parse_args()
    print(render(args.node, args.cert, args.key, args.http_listen, args.https_listen,
                 args.max_fails, args.fail_timeout_s), end="")


if __name__ == "__main__":
    main()
