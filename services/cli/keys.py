"""`polyserve keys create|list|show|delete`: client API keys (issue 14) through the gateway's admin
API (`/v1/keys`), with the admin key `polyserve up` stored (RUN_DIR/secrets/admin.key), or
$POLYSERVE_GATEWAY_ADMIN_API_KEY, or --admin-key-file."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import httpx

from polyserve.cli import launcher
from polyserve.cli.credentials import ADMIN_KEY_ENV


def _target(args: argparse.Namespace) -> tuple[str, str]:
    """(gateway URL, admin key) from the flags, the environment or the run dir of `polyserve up`."""
    run_dir = Path(args.run_dir)
    url = args.url
    if not url:
        state = launcher.ClusterState.load(run_dir)
        if state is None:
            raise SystemExit(f"polyserve is not running (no state in {run_dir}); start it with `polyserve up` "
                             "or pass --url")
        url = state.gateway_url
    if args.admin_key_file:
        key = Path(args.admin_key_file).read_text().strip()
    else:
        key = os.environ.get(ADMIN_KEY_ENV) or launcher.read_admin_key(run_dir)
    return url.rstrip("/"), key


def _call(args: argparse.Namespace, method: str, path: str, body: dict | None = None) -> dict:
    url, key = _target(args)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        r = httpx.request(method, url + path, json=body, headers=headers, timeout=10)
    except httpx.HTTPError as exc:
        raise SystemExit(f"cannot reach the gateway at {url}: {exc}") from None
    if r.status_code >= 400:
        try:
            msg = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            msg = r.text
        raise SystemExit(f"{method} {path}: {r.status_code}: {msg}")
    return r.json()


def _limits(k: dict) -> str:
    return f"rpm {k['rpm'] or '-'}, tpm {k['tpm'] or '-'}, priority {k['priority']}"


def cmd_create(args: argparse.Namespace) -> int:
    body = {"tenant": args.tenant, "name": args.name, "models": args.model or [], "rpm": args.rpm, "tpm": args.tpm,
            "priority": args.priority}
    k = _call(args, "POST", "/v1/keys", body)
    if args.json:
        print(json.dumps(k, indent=2))
        return 0
    print(f"created key {k['id']} for tenant {k['tenant']} ({_limits(k)}; models: "
          f"{', '.join(k['models']) or 'all'})")
    print(f"\n  {k['key']}\n")
    print("This is the only time the key is shown (polyserve stores its hash); give it to the client as "
          "`Authorization: Bearer <key>` (OPENAI_API_KEY).")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    keys = _call(args, "GET", "/v1/keys")["data"]
    if args.json:
        print(json.dumps(keys, indent=2))
        return 0
    if not keys:
        print("no client API keys (polyserve keys create --tenant NAME)")
    for k in keys:
        print(f"{k['id']}  tenant {k['tenant']:<16} {_limits(k)}  models: {', '.join(k['models']) or 'all'}"
              f"{'  (' + k['name'] + ')' if k['name'] else ''}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    print(json.dumps(_call(args, "GET", f"/v1/keys/{args.id}"), indent=2))
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    _call(args, "DELETE", f"/v1/keys/{args.id}")
    print(f"revoked key {args.id} (every gateway refuses it within key_cache_s, 2 s by default)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="polyserve keys", description="client API keys (admin)")
    p.add_argument("--run-dir", default=str(launcher.default_run_dir()), help="the run dir of `polyserve up`")
    p.add_argument("--url", help="the gateway (default: the one `polyserve up` started)")
    p.add_argument("--admin-key-file", help=f"file holding the admin key (default: ${ADMIN_KEY_ENV}, else "
                                            "RUN_DIR/secrets/admin.key)")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("create", help="create a key; prints its secret once")
    c.add_argument("--tenant", required=True)
    c.add_argument("--name", default="", help="a note for the operator")
    c.add_argument("--model", action="append", help="a model the key may use (repeat; default: all)")
    c.add_argument("--rpm", type=int, default=0, help="requests per minute (0 = no limit)")
    c.add_argument("--tpm", type=int, default=0, help="prompt + completion tokens per minute (0 = no limit)")
    c.add_argument("--priority", choices=("high", "normal", "low"), default="normal",
                   help="class under contention (fair sharing)")
    c.add_argument("--json", action="store_true")
    c.set_defaults(fn=cmd_create)
    ls = sub.add_parser("list", help="the keys (never their secrets)")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(fn=cmd_list)
    sh = sub.add_parser("show", help="one key and its usage (requests, tokens)")
    sh.add_argument("id")
    sh.set_defaults(fn=cmd_show)
    d = sub.add_parser("delete", help="revoke a key")
    d.add_argument("id")
    d.set_defaults(fn=cmd_delete)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return args.fn(args)
