"""``omni-ctl``: talk to a running job's control socket.

    omni-ctl --run-dir runs/demo status
    omni-ctl -s runs/demo/control.sock pause
    omni-ctl -s 127.0.0.1:7700 --token-file ~/.omni-token metrics --last 5
    omni-ctl -s runs/demo/control.sock config set train.eval_interval 50
    omni-ctl -s runs/demo/control.sock --json status
    omni-ctl --run-dir runs/elastic/r1 join

Exit codes: 0 ok, 1 the job refused the command (error printed), 2 bad usage,
3 no connection / no reply in time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any, Optional, Sequence

import yaml

from megascale_omni.control.client import ControlClient, endpoint_of_run, parse_target
from megascale_omni.control.protocol import ProtocolError

EXIT_REFUSED, EXIT_USAGE, EXIT_CONNECTION = 1, 2, 3
TOKEN_ENV = "MEGASCALE_CONTROL_TOKEN"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="omni-ctl", description="Control a running megascale-omni job (see docs/control-protocol.md).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("-s", "--socket", metavar="PATH|HOST:PORT", help="Unix socket path or TCP host:port")
    where.add_argument("--run-dir", metavar="DIR", help="the job's logging.output_dir (reads DIR/control.json)")
    p.add_argument("--tcp", action="store_true", help="with --run-dir: use the job's TCP endpoint")
    p.add_argument("--token-file", metavar="FILE", help=f"token for TCP (default: ${TOKEN_ENV})")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S",
                   help="seconds to wait for a reply; deferred commands reply at the next step boundary (60)")
    p.add_argument("--json", action="store_true", help="print the raw JSON reply")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    sub.add_parser("status", help="step, state, layout, last loss, uptime")
    m = sub.add_parser("metrics", help="last step record(s)")
    m.add_argument("--last", type=int, default=1, metavar="N", help="how many records (1..100)")
    sub.add_parser("checkpoint", help="save a checkpoint at the next step boundary")
    sub.add_parser("drain", help="finish the current step, stop every rank, exit 0")
    sub.add_parser("pause", help="hold training at the next step boundary")
    sub.add_parser("resume", help="continue after pause")
    sub.add_parser("join", help="a standby replica group (elastic.standby=true) joins the elastic quorum")
    c = sub.add_parser("config", help="get the config or set a run-time mutable field")
    csub = c.add_subparsers(dest="action", required=True, metavar="ACTION")
    g = csub.add_parser("get", help="whole config, or one field")
    g.add_argument("field", nargs="?", help="dotted name, e.g. train.eval_interval")
    s = csub.add_parser("set", help="set a mutable field at the next step boundary")
    s.add_argument("field", help="dotted name, e.g. train.eval_interval")
    s.add_argument("value", help="new value, read as a YAML scalar (5, 0.02, true)")
    return p


def request_of(args: argparse.Namespace) -> tuple[str, dict]:
    if args.cmd == "metrics":
        return "metrics", {"last": args.last}
    if args.cmd == "config":
        out: dict[str, Any] = {"action": args.action}
        if args.field is not None:
            out["field"] = args.field
        if args.action == "set":
            out["value"] = _scalar(args.value)
        return "config", out
    return args.cmd, {}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if not (math.isfinite(args.timeout) and args.timeout > 0):
            raise ValueError(f"--timeout {args.timeout} must be a positive number of seconds")
        address = _address(args)
        token = _token(args)
    except ValueError as e:
        print(f"omni-ctl: {e}", file=sys.stderr)
        return EXIT_USAGE
    cmd, cmd_args = request_of(args)
    try:
        with ControlClient(address, token=token, timeout_s=args.timeout) as client:
            reply = client.request(cmd, cmd_args)
    except (OSError, ConnectionError, ProtocolError) as e:
        where = address if isinstance(address, str) else f"{address[0]}:{address[1]}"
        print(f"omni-ctl: cannot talk to {where}: {e}", file=sys.stderr)
        return EXIT_CONNECTION
    if args.json:
        print(json.dumps(reply, indent=2, sort_keys=True))
        return 0 if reply["ok"] else EXIT_REFUSED
    if not reply["ok"]:
        error = reply.get("error") or {}
        hint = error.get("hint") or ""
        hint = f" (fix: {hint})" if hint and hint not in str(error.get("message")) else ""
        print(f"error [{error.get('code')}]: {error.get('message')}{hint}", file=sys.stderr)
        return EXIT_REFUSED
    print(format_result(cmd, cmd_args, reply["result"]))
    return 0


def format_result(cmd: str, args: dict, result: dict) -> str:
    """Human-readable rendering of a successful result."""
    if cmd == "status":
        layout = result.get("layout") or {}
        lines = [
            f"state        {result.get('state')}",
            f"step         {result.get('step')} / {result.get('total_steps')}",
            f"last loss    {_num(result.get('last_loss'))}",
            "layout       " + " ".join(f"{k}={v}" for k, v in layout.items() if v is not None and k != "world_size"),
            f"world size   {result.get('world_size')}",
            f"uptime       {_num(result.get('uptime_s'))} s",
            f"pending      {result.get('pending_commands')} command(s)",
            f"checkpoint   {'available' if result.get('checkpointing') else 'not configured'}",
            f"host / pid   {result.get('host')} / {result.get('pid')}",
        ]
        if result.get("replica"):
            lines.append("replica      " + " ".join(f"{k}={v}" for k, v in result["replica"].items()))
        return "\n".join(lines)
    if cmd == "metrics":
        records = result.get("records") or []
        if not records:
            return "no step finished yet"
        cols = ["step", "loss", "lr", "grad_norm", "tokens_per_s", "step_s", "data_s", "fwd_bwd_s", "optimizer_s"]
        rows = [cols] + [[_num(r.get(c)) for c in cols] for r in records]
        widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
        return "\n".join("  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows)
    if cmd == "config":
        if args["action"] == "set":
            return f"{result['field']}: {result['old']!r} -> {result['new']!r} (applied at step {result['step']})"
        if "field" in result:
            return f"{result['field']} = {result['value']!r}" + ("  (mutable)" if result.get("mutable") else "")
        text = yaml.safe_dump(result["config"], sort_keys=False).rstrip()
        return text + "\n# mutable while running: " + ", ".join(result["mutable"])
    if cmd == "checkpoint":
        where = result.get("checkpoint")
        if isinstance(where, dict) and where.get("writer") is False:
            return (f"not saved at step {result['step']}: this elastic replica group does not write checkpoints; "
                    "send checkpoint to the group whose status shows participant_rank=0")
        return f"checkpoint saved at step {result['step']}: {where}"
    changed = "" if result.get("changed", True) else " (no change)"
    return f"{result['state']} at step {result['step']}{changed}"


def _address(args: argparse.Namespace):
    if args.socket:
        return parse_target(args.socket)
    run_dir = args.run_dir or os.environ.get("MEGASCALE_RUN_DIR")
    if not run_dir:
        raise ValueError("say where the job is: --socket PATH|HOST:PORT or --run-dir DIR")
    return endpoint_of_run(run_dir, prefer="tcp" if args.tcp else "unix")


def _token(args: argparse.Namespace) -> Optional[str]:
    # Never a --token option: command lines are visible to every user in ps.
    if args.token_file:
        try:
            with open(args.token_file, encoding="utf-8") as f:
                return f.readline().strip() or None
        except OSError as e:
            raise ValueError(f"cannot read --token-file {args.token_file}: {e.strerror}") from None
    return os.environ.get(TOKEN_ENV) or None


def _scalar(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _num(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.0f}"
    return str(value)


def cli() -> None:
    """Console-script entry point."""
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:  # e.g. `omni-ctl ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    sys.exit(code)


if __name__ == "__main__":
    cli()
