"""``python -m aitrainsai_tinker_local_server --port 0 --state-dir DIR [--api-key KEY] [--ready-file FILE]``:
serve the Tinker API on 127.0.0.1 (``--dtype auto`` by default: bfloat16 on a GPU, float32 on a CPU) until SIGTERM or
Ctrl-C (or, with ``--parent-fd``, until the process that started it exits). Prints one line with the base URL once
listening (the model loaded), and the key it made when none was given; bad input ends with one line on stderr and
exit status 2."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import re
import secrets
import signal
import sys
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"


SERVE_AS_ENV = "AITRAINSAI_TINKER_SERVE_AS"
HOST_NAME = re.compile(r"[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?(:[0-9]{1,5})?")  # an --allow-host value, lowercased


class ServeError(Exception):
    """A reason to refuse to start, said in one line."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="aitrainsai tinker-serve", description=__doc__)
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (0: a free one)")
    parser.add_argument("--state-dir", type=Path, required=True, help="checkpoints and exports live here")
    parser.add_argument("--api-key", default=None,
                        help="accept only this key (default: $AITRAINSAI_TINKER_SERVE_KEY, else one made for this "
                             "start and printed)")
    parser.add_argument("--allow-host", action="append", default=None, metavar="NAME",
                        help="a Host name it answers besides 127.0.0.1 and localhost (HOST, at the bound port, or "
                             "HOST:PORT; repeat for more): for a tunnel or proxy that keeps its own name")
    parser.add_argument("--ready-file", type=Path, default=None, help="write {base_url, pid} here when ready")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                        help="compute dtype of sampling and the forward/backward (the adapter and Adam state stay "
                             "float32; auto: bfloat16 on a GPU, float32 on a CPU)")
    parser.add_argument("--rates", default=None,
                        help='the billing rate card, USD per million tokens, as JSON: {"prefill": 0.54, '
                             '"prefill_cached": 0.108, "sampled": 1.335, "trained": 1.177} (default: all zero)')
    parser.add_argument("--billing-key", default=None,
                        help="only this key may read billing usage (others get 403), and it is accepted besides "
                             "--api-key (default: $AITRAINSAI_TINKER_SERVE_BILLING_KEY, else any accepted key)")
    parser.add_argument("--serve-as", action="append", default=None, metavar="NAME",
                        help="a base-model name its one model answers to, and the only ones it lists (repeat for "
                             "more; default: SmolLM2-135M-Instruct): to test what a service offering NAME does at "
                             "start; token ids past the local vocabulary are refused")
    parser.add_argument("--verbose", action="store_true", help="log every request")
    parser.add_argument("--parent-fd", type=int, default=None,
                        help="the read end of a pipe the starting process holds open: stop when it closes (the "
                             "parent exited, however it ended)")
    return parser.parse_args(argv)


def serve(port: int, state_dir: Path, *, api_key: str | None = None, ready_file: Path | None = None,
          device: str | None = None, verbose: bool = False, parent_fd: int | None = None,
          rates: str | None = None, billing_key: str | None = None, dtype: str = "auto",
          allow_hosts: list[str] | None = None, test_routes: bool = False) -> int:
    """Run the server in this process until SIGTERM/SIGINT; returns the exit status (2: refused to start). Without
    ``api_key`` it makes one and prints it once. ``test_routes``: serve the test server's fault switch too (only
    ``testing.serve_for_tests`` asks; no command line does)."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        _check_inputs(port, state_dir, api_key)
        hosts = _allowed_hosts(allow_hosts or [])
        if dtype not in ("auto", "bfloat16", "float32"):
            raise ServeError(f"--dtype {dtype!r} is not auto, bfloat16 or float32")
        if dtype == "bfloat16":
            # oneDNN's AMX kernels block a bf16 matmul by its row count: a one-token decode then rounds unlike the
            # training forward over the sequence (log-probs up to 0.1 apart, measured); AVX512-BF16 kernels do not.
            # Read when oneDNN makes its first kernel, so set before any torch work in this process.
            os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
        billing = _billing(rates, billing_key)
        made = api_key is None
        key = api_key if api_key is not None else "tml-" + secrets.token_urlsafe(32)
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how a user stops it
            asyncio.run(_serve(port, state_dir.resolve(), key, ready_file, device, verbose, parent_fd, billing,
                               dtype, hosts=hosts, show_key=made, test_routes=test_routes))
    except ServeError as error:
        print(f"aitrainsai tinker-serve: {error}", file=sys.stderr)
        return 2
    return 0


def _check_inputs(port: int, state_dir: Path, api_key: str | None) -> None:
    if not 0 <= port <= 65535:
        raise ServeError(f"port {port} is outside 0..65535")
    if api_key is not None and not api_key.startswith("tml-"):
        raise ServeError("--api-key must start with 'tml-' (the tinker SDK sends no other keys)")
    try:
        (state_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        probe = state_dir / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise ServeError(f"the state dir {state_dir} is not writable: {error.strerror}") from None


def _allowed_hosts(names: list[str]) -> list[str]:
    hosts = []
    for name in names:
        host = name.strip().lower()
        if not HOST_NAME.fullmatch(host) or (":" in host and not 0 < int(host.rsplit(":", 1)[1]) <= 65535):
            raise ServeError(f"--allow-host {name[:80]!r} is not a host name (HOST or HOST:PORT)")
        hosts.append(host)
    return hosts


def _billing(rates: str | None, billing_key: str | None):
    from pydantic import ValidationError

    from aitrainsai_tinker_local_server.billing import Billing, Rates

    if billing_key is not None and not billing_key.startswith("tml-"):
        raise ServeError("--billing-key must start with 'tml-' (the tinker SDK sends no other keys)")
    try:
        return Billing(Rates.parse(rates), billing_key=billing_key)
    except (ValueError, ValidationError) as error:
        raise ServeError(f"--rates is not a rate card: {' '.join(str(error).split())[:200]}") from None


async def _serve(port: int, state_dir: Path, api_key: str, ready_file: Path | None, device: str | None,
                 verbose: bool, parent_fd: int | None = None, billing=None, dtype: str = "auto", *,
                 hosts: list[str], show_key: bool, test_routes: bool) -> None:
    from aiohttp import web

    from aitrainsai_tinker_local_server.app import LocalTinker
    from aitrainsai_tinker_local_server.engine import Engine

    try:
        engine = Engine(state_dir, device=device, dtype=dtype)
    except FileNotFoundError as error:  # the base model's package is missing
        raise ServeError(str(error)) from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if parent_fd is not None:  # the parent's end closes when it exits, SIGKILL included: then stop too
        def parent_readable() -> None:
            if not os.read(parent_fd, 1):  # end of file: the parent is gone
                stop.set()

        loop.add_reader(parent_fd, parent_readable)
    server = LocalTinker(engine, api_key=api_key, billing=billing)
    names = [n for n in os.environ.get(SERVE_AS_ENV, "").split(",") if n]
    if names:
        server.names = tuple(dict.fromkeys(names))
    runner = web.AppRunner(server.app(test_routes=test_routes),
                           access_log=logging.getLogger("aiohttp.access") if verbose else None)
    await runner.setup()
    site = web.TCPSite(runner, HOST, port, reuse_address=False)
    try:
        await site.start()
    except OSError as error:
        await runner.cleanup()
        raise ServeError(f"cannot listen on {HOST}:{port}: {error.strerror or error}") from None
    try:
        bound = runner.addresses[0][1]
        base_url = f"http://{HOST}:{bound}"
        # Host names it answers: its address and localhost at the bound port, and the --allow-host names
        server.allowed_hosts = frozenset([f"{HOST}:{bound}", f"localhost:{bound}",
                                          *(h if ":" in h else f"{h}:{bound}" for h in hosts)])
        # the model loads on the worker thread, so requests that come early queue behind it
        warm = loop.run_in_executor(server.worker, engine.warm_up)
        waiting: list[asyncio.Future[Any]] = [warm, asyncio.ensure_future(stop.wait())]
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set():
            return
        if ready_file is not None:
            temporary = ready_file.with_name(ready_file.name + ".tmp")
            temporary.write_text(json.dumps({"base_url": base_url, "pid": os.getpid(),
                                             "dtype": engine.compute_dtype}))
            temporary.rename(ready_file)
        print(f"local Tinker server listening on {base_url} ({engine.compute_dtype}, state dir {state_dir})",
              flush=True)
        if show_key:  # once, for the operator; never written to the state dir
            print(f"API key (made for this start; --api-key or $AITRAINSAI_TINKER_SERVE_KEY chooses one): {api_key}",
                  flush=True)
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None, *, test_routes: bool = False) -> int:
    args = parse_args(argv)
    if args.serve_as:
        os.environ[SERVE_AS_ENV] = ",".join(args.serve_as)
    api_key = args.api_key or os.environ.get("AITRAINSAI_TINKER_SERVE_KEY") or None
    billing_key = args.billing_key or os.environ.get("AITRAINSAI_TINKER_SERVE_BILLING_KEY") or None
    return serve(args.port, args.state_dir, api_key=api_key, ready_file=args.ready_file, device=args.device,
                 verbose=args.verbose, parent_fd=args.parent_fd, rates=args.rates, billing_key=billing_key,
                 dtype=args.dtype, allow_hosts=args.allow_host, test_routes=test_routes)


def exit_now(status: int) -> None:
    """End the process once the server has stopped: a call still running on the model's worker thread (a long
    generation) is abandoned, not waited for (the interpreter would join the thread first; checkpoints are written
    whole or not at all)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    exit_now(main())
