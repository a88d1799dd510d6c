"""``aitrainsai tinker-serve``: the local Tinker-compatible server (imports nothing heavy until it runs)."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("tinker-serve")
@click.option("--port", type=int, default=0, show_default=True, help="Port on 127.0.0.1 (0: a free one).")
@click.option("--state-dir", type=click.Path(path_type=Path), required=True,
              help="Where checkpoints and exported adapters live (a new server on the same dir resumes them).")
@click.option("--api-key", default=None, envvar="AITRAINSAI_TINKER_SERVE_KEY",
              help="Accept only this key (default: one made for this start, printed once).")
@click.option("--allow-host", multiple=True, metavar="NAME",
              help="A Host name it answers besides 127.0.0.1 and localhost (HOST at the bound port, or HOST:PORT; "
                   "repeat for more), for a tunnel or proxy that keeps its own name.")
@click.option("--ready-file", type=click.Path(path_type=Path), default=None,
              help="Write {base_url, pid} as JSON here once listening.")
@click.option("--device", default=None, help="torch device (default: cuda if available, else cpu).")
@click.option("--dtype", type=click.Choice(["auto", "bfloat16", "float32"]), default="auto", show_default=True,
              help="Compute dtype of sampling and the forward/backward (adapter and Adam state stay float32); "
                   "auto: bfloat16 on a GPU, float32 on a CPU.")
@click.option("--rates", default=None,
              help='Billing rate card, USD per million tokens, as JSON: {"prefill": 0.54, "prefill_cached": 0.108, '
                   '"sampled": 1.335, "trained": 1.177} (default: all zero).')
@click.option("--billing-key", default=None, envvar="AITRAINSAI_TINKER_SERVE_BILLING_KEY",
              help="Only this key may read billing usage (others get 403); accepted besides --api-key.")
@click.option("--verbose", is_flag=True, help="Log every request.")
def tinker_serve(port: int, state_dir: Path, api_key: str | None, allow_host: tuple[str, ...],
                 ready_file: Path | None, device: str | None, dtype: str, rates: str | None, billing_key: str | None,
                 verbose: bool) -> None:
    """Serve the Tinker API (as tinker 0.38 speaks it) on 127.0.0.1 with SmolLM2-135M-Instruct and LoRA.

    Point the SDK at it: tinker.ServiceClient(base_url=URL, api_key=KEY). Prints the URL once listening, and the
    key it made when none was given.
    """
    from aitrainsai_tinker_local_server.__main__ import exit_now, serve

    status = serve(port, state_dir, api_key=api_key, ready_file=ready_file, device=device, verbose=verbose,
                   rates=rates, billing_key=billing_key, dtype=dtype, allow_hosts=list(allow_host))
    if status:  # refused before serving
        raise SystemExit(status)
    exit_now(0)  # stopped: a generation still on the worker thread does not hold the exit
