"""A local Tinker-compatible server: the Tinker HTTP API as ``tinker==0.38.0`` speaks it, served on loopback by
SmolLM2-135M-Instruct with a LoRA adapter (the local trainer's public runtime), on CPU or one GPU.

What is real: sessions and heartbeats; LoRA training clients (rank from the request; attention and MLP projections;
``seed`` seeds the adapter's init); ``forward`` and ``forward_backward`` with the real losses (``cross_entropy``,
``importance_sampling``, ``ppo``, ``cispo``: sums over tokens and datums, as the service documents) and gradients that
accumulate until ``optim_step``; AdamW steps with Tinker's ``AdamParams`` (defaults included, decoupled weight decay,
global-norm clipping); sampler weights per version (a frozen copy of the adapter, so later training never changes an
existing sampler); sampling with the per-token log-probs of the sampled tokens at the requested temperature
(``max_tokens``, stop tokens and strings, ``seed``, ``num_samples``); prompt log-probs (``compute_logprobs``);
``save_state`` / ``create_training_client_from_state(_with_optimizer)`` / ``load_state*`` (adapter and Adam state
on disk under the state dir, so a new server on the same dir resumes them); ``save_weights_external`` (a PEFT
adapter folder; ``RestClient.get_external_weights_urls`` answers ``file://`` URLs to its files); futures that
complete later and are polled through ``retrieve_future``; each session's ``user_metadata`` and its usage, hour by
hour, priced at the ``--rates`` it was started with (``AdminClient.get_billing_usage``; see :mod:`.billing`).

What differs from the hosted service: one model (``SmolLM2-135M-Instruct``); LoRA alpha is fixed at 32 (the rank
comes from the request); ``train_unembed=True`` is refused (this runtime puts no LoRA on the tied unembedding: pass
``train_unembed=False``); ``top_k``/``top_p`` other than the defaults, top-k log-probs, ``target_prompt_logprobs``,
``prompt_alt_tokens``, image chunks, custom server-side losses and "inflight" samplers are refused with a 400;
temperature 0 samples greedily and reports log-probs at temperature 1; metrics are ``loss:sum`` and a few of our
own (no MoE router statistics); one model works at a time (requests are serialised on one worker thread), TTLs are
ignored, and checkpoints never expire; ``prompt_cache_hit_tokens`` is an accounting stand-in (no KV cache: the
longest prefix shared with the session's earlier sequences).

    with start_local_server(state_dir) as server:
        client = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key)

This module imports nothing heavy; the server itself runs in a subprocess (``python -m
aitrainsai_tinker_local_server``, also ``aitrainsai tinker-serve``). :func:`local_chat` is how a client renders
prompts for its model.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Self

if TYPE_CHECKING:
    from aitrainsai import ChatTokens

__all__ = ["MODEL_NAME", "LocalServerError", "LocalServerProcess", "local_chat", "start_local_server"]

MODEL_NAME = "SmolLM2-135M-Instruct"


@lru_cache(maxsize=1)
def local_chat() -> ChatTokens:
    """The served model's tokenizer and chat format (ChatML with its default system message), from the local
    trainer's public runtime: what a client renders its prompts with. Loads no weights (imports torch)."""
    from aitrainsai_trainer_local.local_model import load_chat

    return load_chat()


class LocalServerError(RuntimeError):
    """The local server could not be started (its own one-line reason included)."""


class LocalServerProcess:
    """A running local server subprocess (its own process group): ``base_url``, ``api_key`` (the one key it takes
    besides a billing key), ``stop()``, ``kill()``.

    ``lifeline`` is this process's end of a pipe the server watches: it closes when this process exits, however it
    ends (SIGKILL included), and the server stops then."""

    def __init__(self, process: subprocess.Popen, base_url: str, state_dir: Path, log_path: Path,
                 lifeline: int | None = None, dtype: str = "", api_key: str = ""):
        self.process = process
        self.base_url = base_url
        self.api_key = api_key
        self.dtype = dtype  # what its model computes in, as the server reported it when ready
        self.state_dir = state_dir
        self.log_path = log_path
        self.lifeline = lifeline

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the server's process group, then SIGKILL it if it has not exited within ``timeout``."""
        if self.alive():
            self._signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout)
        self.kill()

    def kill(self) -> None:
        """SIGKILL the server's process group (what a crash looks like to clients)."""
        if self.alive():
            self._signal(signal.SIGKILL)
        self.process.wait()
        lifeline, self.lifeline = self.lifeline, None
        if lifeline is not None:
            os.close(lifeline)

    def _signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, sig)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"LocalServerProcess(base_url={self.base_url!r}, pid={self.pid})"


def start_local_server(state_dir: Path | str, *, api_key: str | None = None, timeout: float = 120.0,
                       port: int = 0, device: str | None = None, python: str | None = None,
                       rates: dict[str, float] | None = None, billing_key: str | None = None,
                       serve_as: list[str] | None = None, dtype: str = "auto",
                       base: str | None = None, test_routes: bool = False) -> LocalServerProcess:
    """Start the server as a subprocess on 127.0.0.1 (a free port unless ``port``) keeping its state in
    ``state_dir``, and wait until it listens (the model is loaded by then). It takes only ``api_key`` (default: one
    made here; either way ``.api_key``, passed in the server's environment, never on a command line or in a file).
    ``rates`` (USD per million tokens: ``prefill``, ``prefill_cached``, ``sampled``, ``trained``; default zero)
    price its billing usage; with ``billing_key`` only that key (accepted besides ``api_key``) may read it.
    ``dtype`` (``auto``: bfloat16 on a GPU, float32 on a CPU; or ``bfloat16``, ``float32``) is what sampling and the
    forward/backward compute in (adapter and Adam state stay float32). Its log is ``state_dir/server.log``. Raises
    :class:`LocalServerError` with the server's own reason when it exits first or is not ready within ``timeout``
    seconds. ``base`` names the local trainer's base the server loads (``AITRAINSAI_LOCAL_BASE``; default: this
    process's): ``"tiny-llama"`` serves the mechanics tests' two-layer model under the same names. ``test_routes``:
    the test server's fault switch too (``testing.serve_for_tests``)."""
    if dtype not in ("auto", "bfloat16", "float32"):
        raise LocalServerError(f"dtype {dtype!r} is not auto, bfloat16 or float32")
    state_dir = Path(state_dir).resolve()
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise LocalServerError(f"cannot create the state dir {state_dir}: {error.strerror}") from None
    ready_file = state_dir / f"ready-{os.getpid()}-{time.monotonic_ns()}.json"
    log_path = state_dir / "server.log"
    watched, lifeline = os.pipe()  # the server stops when this process's end closes: at its exit, whatever ends it
    module = "aitrainsai_tinker_local_server.testing" if test_routes else "aitrainsai_tinker_local_server"
    command = [python or sys.executable, "-m", module, "--port", str(port),
               "--state-dir", str(state_dir), "--ready-file", str(ready_file), "--parent-fd", str(watched),
               "--dtype", dtype]
    if device:
        command += ["--device", device]
    if rates:
        command += ["--rates", json.dumps(rates)]
    for name in serve_as or []:  # names its one model answers to (``--serve-as``)
        command += ["--serve-as", name]
    env = dict(os.environ)
    if base is not None:
        from aitrainsai_trainer_local.model import BASE_VARIABLE

        env[BASE_VARIABLE] = base
    api_key = api_key if api_key is not None else "tml-" + secrets.token_urlsafe(32)
    env["AITRAINSAI_TINKER_SERVE_KEY"] = api_key  # not on the command line, where `ps` shows it
    if billing_key is not None:
        env["AITRAINSAI_TINKER_SERVE_BILLING_KEY"] = billing_key
    try:
        try:
            log = log_path.open("ab")
        except OSError as error:
            raise LocalServerError(f"cannot write {log_path}: {error.strerror}") from None
        with log:
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                       start_new_session=True, pass_fds=(watched,))
    except BaseException:
        os.close(lifeline)
        raise
    finally:
        os.close(watched)
    server = LocalServerProcess(process, "", state_dir, log_path, lifeline=lifeline, api_key=api_key)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if ready_file.is_file():
                info = json.loads(ready_file.read_text())
                server.base_url = info["base_url"]
                server.dtype = info.get("dtype", "")
                return server
            if process.poll() is not None:
                raise LocalServerError(f"the local Tinker server exited ({process.returncode}): {_last_line(log_path)}")
            time.sleep(0.1)
        raise LocalServerError(f"the local Tinker server was not ready within {timeout:.0f} s (log: {log_path})")
    except BaseException:
        server.kill()
        raise
    finally:
        ready_file.unlink(missing_ok=True)


def _last_line(path: Path) -> str:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "(no log)"
    return lines[-1] if lines else "(no output)"
